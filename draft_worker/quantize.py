"""``specd quantize-drafter IN.gguf OUT.gguf --scheme q8_0``: re-quantize a draft GGUF.

Policy (drafters.md §8; LH ``quantize_draft_q8.py``, DB DSpark converter):

* **Q8_0**: every 2-D weight whose ne0 (input dimension) is a multiple of 32 — fc, the attention
  and MLP projections, DFlash 2 conv kernel projections, the selector's hidden projection and
  codebooks, DSpark's Markov factors (codebooks / Markov factors are gathered rows or a GEMV, where
  Q8_0 costs no accuracy that matters; drafters.md §8 allows it). ``--keep REGEX`` leaves chosen
  tensors in their source type (e.g. MD keeps DFlash 2 conv projections and the selector in bf16).
* **kept F32**: every norm gain (1-D; precision-critical, a few KB), the DFlash 2 conv base kernels
  (their per-tap values multiply activations directly and are tiny: 2·taps·H) and the DSpark
  confidence head (a [H(+r), 1] vector and scalar bias whose sigmoid output is thresholded, so small
  absolute errors move decisions; it is also tiny). These are never quantized (MATRIX kind only).
* **kept as is**: a 2-D weight whose ne0 is not a multiple of 32 (Q8_0 blocks are 32 wide), and
  tensors already in a block format.

For each quantized tensor the relative error ``||w − dq(q(w))||₂ / ||w||₂`` (float64) is printed;
the file sizes before and after are printed too. The input is validated with the drafter loader
first, metadata is copied unchanged except ``general.file_type`` / ``general.quantization_version``,
and the output is written atomically.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from .contract import DrafterFormatError, canonical_gguf_name, expected_tensors, q8_0_eligible, tensor_sort_key
from .gguf_loader import load_drafter
from .gguf_meta import copy_fields, write_gguf_atomic

SCHEMES = ("q8_0",)
_FLOAT_TYPES = (QT.F32, QT.F16, QT.BF16)


@dataclass
class TensorReport:
    """One tensor: name, source and output ggml type names, relative error (quantized only) and why
    it was not quantized (``reason``)."""

    name: str
    src_type: str
    dst_type: str
    rel_error: float | None = None
    reason: str = ""


@dataclass
class QuantizeReport:
    """Sizes in bytes before / after, and the per-tensor reports."""

    size_before: int
    size_after: int
    tensors: list[TensorReport] = field(default_factory=list)


def relative_error(w: np.ndarray, dq: np.ndarray) -> float:
    """||w − dq||₂ / ||w||₂ in float64 (0 for an all-zero w that round-trips exactly)."""
    w64, d64 = w.astype(np.float64).ravel(), dq.astype(np.float64).ravel()
    num, den = float(np.linalg.norm(w64 - d64)), float(np.linalg.norm(w64))
    return 0.0 if num == 0.0 else num / den if den > 0 else float("inf")


def quantize_drafter(src: str | os.PathLike, out: str | os.PathLike, scheme: str = "q8_0",
                     keep: Sequence[str] = (), log: Callable[[str], None] = print) -> QuantizeReport:
    """Quantize the draft GGUF ``src`` into ``out`` with ``scheme`` (only ``q8_0``).

    ``keep``: regular expressions (``re.search`` on the GGUF tensor name) of tensors to leave in
    their source type. Raises DrafterFormatError when ``src`` is not a valid draft GGUF (the loader's
    checks) or ``scheme`` is unknown.
    """
    if scheme not in SCHEMES:
        raise DrafterFormatError(f"--scheme {scheme!r}: expected one of {SCHEMES}")
    keep_res = [re.compile(k) for k in keep]
    drafter = load_drafter(src)
    reader = drafter.reader
    expected = expected_tensors(drafter.hparams)
    report = QuantizeReport(size_before=Path(src).stat().st_size, size_after=0)

    def fill(writer: gguf.GGUFWriter) -> None:
        copy_fields(reader, writer, skip=lambda k: k in ("general.file_type", "general.quantization_version"))
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for t in sorted(reader.tensors, key=lambda t: tensor_sort_key(canonical_gguf_name(t.name))):
            spec = expected[canonical_gguf_name(t.name)]
            rep = TensorReport(t.name, t.tensor_type.name, t.tensor_type.name)
            if spec.kind != "matrix":
                rep.reason = "norm: kept F32" if spec.kind == "norm" else "small head / conv base: kept F32"
            elif not q8_0_eligible(spec):
                rep.reason = f"ne0 = {spec.ne[0]} is not a multiple of 32: kept"
            elif any(r.search(t.name) for r in keep_res):
                rep.reason = "--keep: kept"
            elif t.tensor_type not in _FLOAT_TYPES:
                rep.reason = "already block-quantized: kept"
            else:
                w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(tuple(reversed(spec.ne)))
                q = gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), QT.Q8_0)
                rep.rel_error = relative_error(w, gguf.quants.dequantize(q, QT.Q8_0))
                rep.dst_type = "Q8_0"
                writer.add_tensor(t.name, q, raw_dtype=QT.Q8_0)
                report.tensors.append(rep)
                continue
            data = np.asarray(t.data)
            if t.tensor_type == QT.F32:
                writer.add_tensor(t.name, data.view(np.float32))
            elif t.tensor_type == QT.F16:
                writer.add_tensor(t.name, data.view(np.float16))
            else:
                writer.add_tensor(t.name, data.view(np.uint8), raw_dtype=t.tensor_type)
            report.tensors.append(rep)

    write_gguf_atomic(out, drafter.reader.fields["general.architecture"].contents(), fill)
    report.size_after = Path(out).stat().st_size
    width = max(len(r.name) for r in report.tensors)
    for r in report.tensors:
        detail = f"rel err {r.rel_error:.3e}" if r.rel_error is not None else r.reason
        log(f"  {r.name:<{width}}  {r.src_type:>5} -> {r.dst_type:<5}  {detail}")
    errs = [r.rel_error for r in report.tensors if r.rel_error is not None]
    log(f"  quantized {len(errs)} of {len(report.tensors)} tensors to Q8_0"
        + (f"; relative error max {max(errs):.3e}, mean {sum(errs) / len(errs):.3e}" if errs else ""))
    log(f"  size: {report.size_before:,} -> {report.size_after:,} bytes "
        f"({report.size_after / report.size_before:.3f}x)")
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``specd quantize-drafter`` (coordinator/cli.py COMMANDS table)."""
    parser.add_argument("src", help="input draft GGUF (qwen35-dflash-draft)")
    parser.add_argument("out", help="output draft GGUF")
    parser.add_argument("--scheme", choices=SCHEMES, default="q8_0", help="quantization scheme")
    parser.add_argument("--keep", action="append", default=[], metavar="REGEX",
                        help="leave tensors whose GGUF name matches REGEX in their source type (repeatable)")
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")


def run(args: argparse.Namespace) -> int:
    """Run ``specd quantize-drafter``: 0 on success, 1 on a contract error (message on stderr)."""
    out = Path(args.out)
    if out.exists() and not args.force:
        print(f"specd quantize-drafter: {out} exists (pass --force to replace it)", file=sys.stderr)
        return 1
    if Path(args.src).resolve() == out.resolve():
        print("specd quantize-drafter: input and output must differ", file=sys.stderr)
        return 1
    print(f"quantizing {args.src} -> {args.out} ({args.scheme})")
    try:
        quantize_drafter(args.src, out, args.scheme, args.keep)
    except (DrafterFormatError, re.error) as exc:
        print(f"specd quantize-drafter: error: {exc}", file=sys.stderr)
        return 1
    return 0
