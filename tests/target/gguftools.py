"""GGUF surgery for tests: copy a file with keys or tensors changed, and random valid K-quant /
IQ4_XS / Q8_0 blocks (docs/oracles.md §4.3)."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT
from gguf.quants import dequantize

# Byte offsets of the fp16 scale fields in one block: d, and dmin for Q4_K/Q5_K.
SCALE_FIELDS = {QT.Q8_0: (0, None), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208, None), QT.IQ4_XS: (0, None)}
# Mean code times sub-scale ratio that makes d*sc*q - dmin*m roughly zero-mean.
DMIN_RATIO = {QT.Q4_K: 7.5, QT.Q5_K: 15.5}


def _fields(reader: gguf.GGUFReader):
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if f.types[0] == VT.ARRAY:
            yield key, f.contents(), VT.ARRAY, f.types[-1]
        else:
            yield key, f.contents(), f.types[0], None


def tensor_payload(t) -> tuple[np.ndarray, QT | None]:
    """(array, raw_dtype) that GGUFWriter.add_tensor accepts for a reader tensor, copied."""
    if t.tensor_type == QT.F32:
        return np.array(t.data, dtype=np.float32), None
    if t.tensor_type == QT.F16:
        return np.array(t.data, dtype=np.float16), None
    return np.array(t.data, dtype=np.uint8), t.tensor_type


def rewrite_gguf(src: Path, dst: Path, *, arch: str | None = None, drop_keys=(), set_keys=None,
                 drop_tensors=(), replace_tensors=None, add_tensors=None) -> Path:
    """Copy ``src`` to ``dst`` changing metadata/tensors.

    set_keys: {key: (value, GGUFValueType[, sub_type])}; replace_tensors/add_tensors:
    {name: array or (array, raw_dtype)}; ``arch`` renames general.architecture and the
    ``<old arch>.`` key prefix.
    """
    reader = gguf.GGUFReader(src)
    old_arch = reader.fields["general.architecture"].contents()
    arch = arch or old_arch
    w = gguf.GGUFWriter(dst, arch)
    set_keys = dict(set_keys or {})
    for key, value, vtype, sub in _fields(reader):
        if key in drop_keys or key in set_keys:
            continue
        if key.startswith(old_arch + "."):
            key = arch + key[len(old_arch):]
        w.add_key_value(key, value, vtype, sub_type=sub)
    for key, spec in set_keys.items():
        w.add_key_value(key, spec[0], spec[1], sub_type=spec[2] if len(spec) > 2 else None)
    replace = dict(replace_tensors or {})
    for t in reader.tensors:
        if t.name in drop_tensors:
            continue
        payload = replace.get(t.name, tensor_payload(t))
        _add(w, t.name, payload)
    for name, payload in (add_tensors or {}).items():
        _add(w, name, payload)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _add(w: gguf.GGUFWriter, name: str, payload) -> None:
    array, raw = payload if isinstance(payload, tuple) else (payload, None)
    w.add_tensor(name, array, raw_dtype=raw)


def _set_f16(raw: np.ndarray, offset: int, value: np.ndarray) -> None:
    raw[..., offset:offset + 2] = np.asarray(value, dtype=np.float16)[..., None].view(np.uint8)


def random_blocks(rows: int, cols: int, qtype: QT, rng: np.random.Generator, std: float = 0.03) -> np.ndarray:
    """Random valid blocks of ``qtype`` for a (rows, cols) weight, as uint8 (rows, row_bytes):
    random bytes with finite fp16 scales chosen so the dequantized std is about ``std``."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    d_off, dmin_off = SCALE_FIELDS[qtype]
    d = rng.uniform(0.5, 1.5, size=raw.shape[:2]).astype(np.float32)
    for _ in range(2):  # set scales, measure, rescale (fp16 rounding makes one pass approximate)
        _set_f16(raw, d_off, d)
        if dmin_off is not None:
            _set_f16(raw, dmin_off, d * DMIN_RATIO[qtype])
        measured = dequantize(raw.reshape(rows, -1), qtype).std()
        d = d * np.float32(std / measured)
    return raw.reshape(rows, -1)
