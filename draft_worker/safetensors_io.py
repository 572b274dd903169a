"""Read HF safetensors checkpoints with numpy only (no torch): a single ``model.safetensors``, a
sharded set with ``model.safetensors.index.json``, or every ``*.safetensors`` in a folder.

Format: 8-byte little-endian header length, a JSON header ``{name: {dtype, shape, data_offsets}}``
(offsets relative to the end of the header), then the raw little-endian data. BF16 is widened to
F32 exactly (bit shift); F16 / F64 are converted to F32.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .contract import DrafterFormatError

_DTYPES = {"F32": (np.dtype("<f4"), 4), "F16": (np.dtype("<f2"), 2), "BF16": (np.dtype("<u2"), 2),
           "F64": (np.dtype("<f8"), 8)}
_MAX_HEADER = 256 * 1024 * 1024


@dataclass(frozen=True)
class StTensor:
    """One tensor of a safetensors file: name, dtype (``F32``/``F16``/``BF16``/``F64``), torch-order
    shape, file, absolute byte offset and length."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    offset: int
    nbytes: int

    def read_f32(self) -> np.ndarray:
        """The tensor as a float32 numpy array of ``shape`` (a copy; the file is memory-mapped)."""
        np_dtype, _ = _DTYPES[self.dtype]
        raw = np.memmap(self.file, dtype=np.uint8, mode="r", offset=self.offset, shape=(self.nbytes,))
        arr = raw.view(np_dtype).reshape(self.shape)
        if self.dtype == "BF16":
            return (arr.astype(np.uint32) << 16).view(np.float32)
        return arr.astype(np.float32)


def read_header(path: Path) -> dict[str, StTensor]:
    """Tensor table of one safetensors file. Raises DrafterFormatError on a malformed header or an
    unsupported dtype (integer tables such as speculators' ``d2t`` are not drafter weights)."""
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) != 8:
            raise DrafterFormatError(f"{path}: too short to be a safetensors file")
        n = struct.unpack("<Q", head)[0]
        if n == 0 or n > _MAX_HEADER or 8 + n > size:
            raise DrafterFormatError(f"{path}: invalid safetensors header length {n}")
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DrafterFormatError(f"{path}: invalid safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise DrafterFormatError(f"{path}: invalid safetensors header: not a JSON object")
    base = 8 + n
    data_size = size - base
    out: dict[str, StTensor] = {}
    ranges: list[tuple[int, int, str]] = []

    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise DrafterFormatError(f"{path}: tensor {name!r}: header entry is {type(info).__name__}, expected an object")
        dtype, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in _DTYPES:
            raise DrafterFormatError(f"{path}: tensor {name!r} has dtype {dtype!r}; drafter weights must be "
                                     f"one of {sorted(_DTYPES)}")
        if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
            raise DrafterFormatError(f"{path}: tensor {name!r} has shape {shape!r}; expected a list of non-negative ints")
        if not isinstance(offs, list) or len(offs) != 2 or not all(is_int(o) for o in offs):
            raise DrafterFormatError(f"{path}: tensor {name!r} has data_offsets {offs!r}; expected [start, end] ints")
        start, end = offs
        shape = tuple(shape)
        if not 0 <= start <= end <= data_size:
            raise DrafterFormatError(f"{path}: tensor {name!r} has byte range {offs} outside the data section "
                                     f"(0 .. {data_size} bytes)")
        if end - start != math.prod(shape) * _DTYPES[dtype][1]:
            raise DrafterFormatError(f"{path}: tensor {name!r} has {end - start} bytes for {dtype} {list(shape)} "
                                     f"(expected {math.prod(shape) * _DTYPES[dtype][1]})")
        ranges.append((start, end, name))
        out[name] = StTensor(name, dtype, shape, path, base + start, end - start)
    # safetensors' own rule: the ranges tile the data section exactly (no gaps, overlaps or shifts)
    pos = 0
    for start, end, name in sorted(ranges):
        if start != pos:
            raise DrafterFormatError(f"{path}: tensor {name!r} starts at data byte {start}, expected {pos} "
                                     "(byte ranges overlap or leave a gap: shifted offsets)")
        pos = end
    if pos != data_size:
        raise DrafterFormatError(f"{path}: tensors cover {pos} data bytes but the file holds {data_size} after the header")
    return out


def open_checkpoint(src: str | Path) -> tuple[Path, dict[str, StTensor]]:
    """Locate ``config.json`` and every tensor of an HF drafter checkpoint.

    ``src`` is a folder (``model.safetensors``, or shards listed by ``model.safetensors.index.json``,
    or all ``*.safetensors``) or a single ``.safetensors`` file with ``config.json`` beside it.
    Returns (config path, {name: StTensor}). Raises DrafterFormatError when the config or the
    weights are missing or a tensor name repeats across shards.
    """
    src = Path(src)
    if src.is_file():
        if src.suffix != ".safetensors":
            raise DrafterFormatError(f"{src}: expected an HF folder, a .safetensors file or a .gguf file")
        folder, files = src.parent, [src]
    elif src.is_dir():
        folder = src
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise DrafterFormatError(f"{index}: no weight_map")
            files = sorted({folder / f for f in weight_map.values()})
        elif (folder / "model.safetensors").is_file():
            files = [folder / "model.safetensors"]
        else:
            files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise DrafterFormatError(f"{src}: no safetensors weights found")
    else:
        raise DrafterFormatError(f"{src}: no such file or folder")
    config = folder / "config.json"
    if not config.is_file():
        raise DrafterFormatError(f"{folder}: config.json is missing (it must sit beside the weights)")
    tensors: dict[str, StTensor] = {}
    for f in files:
        if not f.is_file():
            raise DrafterFormatError(f"{f}: shard listed in the index is missing")
        for name, t in read_header(f).items():
            if name in tensors:
                raise DrafterFormatError(f"{f}: tensor {name!r} also appears in {tensors[name].file}")
            tensors[name] = t
    return config, tensors
