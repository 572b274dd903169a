"""Typed access to GGUF metadata, and GGUF writing helpers (atomic output, field copying).

Every getter names the full key and the file in its error, so a missing or mistyped key is
reported as ``<file>: <key> ...``. Built on the PyPI ``gguf`` package (GGUFReader memmaps the
file; no tensor data is read here).
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable

import gguf
from gguf import GGUFValueType as VT

from .contract import DrafterFormatError

_INT_TYPES = {VT.UINT8, VT.INT8, VT.UINT16, VT.INT16, VT.UINT32, VT.INT32, VT.UINT64, VT.INT64}
_FLOAT_TYPES = {VT.FLOAT32, VT.FLOAT64}
_MISSING = object()


class GGUFMeta:
    """Metadata of one GGUF file: ``get_*`` return typed values or raise DrafterFormatError.

    ``path`` is used in messages only. ``fields`` is GGUFReader.fields (key → ReaderField).
    """

    def __init__(self, reader: gguf.GGUFReader, path: str | os.PathLike):
        self.reader = reader
        self.path = str(path)
        self.fields = reader.fields

    def has(self, k: str) -> bool:
        return k in self.fields

    def error(self, k: str, msg: str) -> DrafterFormatError:
        return DrafterFormatError(f"{self.path}: {k} {msg}")

    def _field(self, k: str, required: bool):
        f = self.fields.get(k)
        if f is None and required:
            raise self.error(k, "is missing (required by the draft GGUF contract, drafters.md §7.1)")
        return f

    def get_int(self, k: str, required: bool = True, default: Any = None) -> int | None:
        f = self._field(k, required)
        if f is None:
            return default
        if f.types[0] not in _INT_TYPES:
            raise self.error(k, f"has type {f.types[0].name}, expected an integer")
        return int(f.contents())

    def get_float(self, k: str, required: bool = True, default: Any = None, finite: bool = True) -> float | None:
        f = self._field(k, required)
        if f is None:
            return default
        if f.types[0] not in _FLOAT_TYPES and f.types[0] not in _INT_TYPES:
            raise self.error(k, f"has type {f.types[0].name}, expected a float")
        v = float(f.contents())
        if finite and not math.isfinite(v):
            raise self.error(k, f"= {v} is not finite")
        return v

    def get_bool(self, k: str, required: bool = True, default: Any = None) -> bool | None:
        f = self._field(k, required)
        if f is None:
            return default
        if f.types[0] == VT.BOOL:
            return bool(f.contents())
        if f.types[0] in _INT_TYPES and int(f.contents()) in (0, 1):
            return bool(f.contents())
        raise self.error(k, f"has type {f.types[0].name}, expected a bool")

    def get_str(self, k: str, required: bool = True, default: Any = None) -> str | None:
        f = self._field(k, required)
        if f is None:
            return default
        if f.types[0] != VT.STRING:
            raise self.error(k, f"has type {f.types[0].name}, expected a string")
        return str(f.contents())

    def get_int_array(self, k: str, required: bool = True, default: Any = None) -> list[int] | None:
        f = self._field(k, required)
        if f is None:
            return default
        if f.types[0] != VT.ARRAY or f.types[-1] not in _INT_TYPES:
            raise self.error(k, f"has type {'/'.join(t.name for t in f.types)}, expected an integer array")
        return [int(v) for v in f.contents()]

    def get_bool_array(self, k: str, required: bool = True, default: Any = None,
                       allow_int: bool = False) -> list[bool] | None:
        """A BOOL[] (or, with ``allow_int``, an integer array of 0/1 values)."""
        f = self._field(k, required)
        if f is None:
            return default
        if f.types[0] == VT.ARRAY and f.types[-1] == VT.BOOL:
            return [bool(v) for v in f.contents()]
        if allow_int and f.types[0] == VT.ARRAY and f.types[-1] in _INT_TYPES:
            vals = [int(v) for v in f.contents()]
            if all(v in (0, 1) for v in vals):
                return [bool(v) for v in vals]
        raise self.error(k, f"has type {'/'.join(t.name for t in f.types)}, expected a BOOL array")


def field_value(field) -> tuple[Any, VT, VT | None]:
    """(value, type, array sub-type) of a ReaderField, ready for GGUFWriter.add_key_value."""
    main = field.types[0]
    if main == VT.ARRAY:
        return list(field.contents()), main, field.types[-1]
    return field.contents(), main, None


READER_INTERNAL_KEYS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture", "general.alignment")


def copy_fields(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, skip: Callable[[str], bool] = lambda k: False) -> None:
    """Copy every metadata field of ``reader`` to ``writer`` except the reader's bookkeeping
    fields, ``general.architecture`` (the writer sets it), ``general.alignment`` (the writer
    lays data out with its own alignment) and keys for which ``skip`` is true."""
    for k, f in reader.fields.items():
        if k in READER_INTERNAL_KEYS or skip(k):
            continue
        v, t, sub = field_value(f)
        writer.add_key_value(k, v, t, sub)


def write_gguf_atomic(path: str | os.PathLike, arch: str, fill: Callable[[gguf.GGUFWriter], None]) -> None:
    """Create ``path`` atomically: ``fill(writer)`` adds keys and tensors to a GGUFWriter for
    ``arch`` that writes a temporary file beside ``path``; it replaces ``path`` only when complete.
    A failure leaves no partial output."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial.{os.getpid()}")
    writer = gguf.GGUFWriter(tmp, arch)
    try:
        fill(writer)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        writer = None
        os.replace(tmp, path)
    finally:
        if writer is not None:
            try:
                writer.close()
            except Exception:  # noqa: BLE001 - cleanup after the original error
                pass
        tmp.unlink(missing_ok=True)
