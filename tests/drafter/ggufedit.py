"""Rewrite a GGUF with edited metadata or tensors (test support: builds bad inputs from good ones)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from specd.draft_worker.gguf_meta import copy_fields, write_gguf_atomic


def rewrite(src: Path, dst: Path, *, drop_keys=(), set_keys: dict[str, tuple[Any, gguf.GGUFValueType]] | None = None,
            arch: str | None = None, drop_tensors=(), rename_tensors: dict[str, str] | None = None,
            replace_tensors: dict[str, np.ndarray] | None = None) -> Path:
    """Copy ``src`` to ``dst`` with keys dropped / set (value, GGUFValueType; arrays as (list, ARRAY,
    subtype)), the architecture changed, tensors dropped / renamed / replaced by numpy arrays."""
    reader = gguf.GGUFReader(src)
    set_keys = set_keys or {}
    rename_tensors = rename_tensors or {}
    replace_tensors = replace_tensors or {}
    arch = arch or reader.fields["general.architecture"].contents()

    def fill(w: gguf.GGUFWriter) -> None:
        copy_fields(reader, w, skip=lambda k: k in drop_keys or k in set_keys)
        for k, v in set_keys.items():
            w.add_key_value(k, *v)
        for t in reader.tensors:
            if t.name in drop_tensors:
                continue
            name = rename_tensors.get(t.name, t.name)
            if t.name in replace_tensors:
                w.add_tensor(name, replace_tensors[t.name])
                continue
            data = np.asarray(t.data)
            if t.tensor_type == QT.F32:
                w.add_tensor(name, data.view(np.float32))
            elif t.tensor_type == QT.F16:
                w.add_tensor(name, data.view(np.float16))
            else:
                w.add_tensor(name, data.view(np.uint8), raw_dtype=t.tensor_type)

    write_gguf_atomic(dst, arch, fill)
    return dst
