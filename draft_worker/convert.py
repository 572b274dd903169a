"""``specd convert-drafter SRC OUT.gguf``: HF drafter checkpoint → draft GGUF (drafters.md §7).

SRC is one of

* an HF folder (``config.json`` + ``model.safetensors`` or shards) or a single ``model.safetensors``
  with its ``config.json`` beside it: z-lab DFlash, DFlash 2 (grouped dynamic convs + candidate
  selector) and DSpark (DeepSpec / SpecForge, heads inline in model.safetensors). Keys are read
  nested-then-top-level and cross-checked against every tensor shape (:mod:`.hf_config`);
* a GGUF in the mainline llama.cpp ``dflash`` dialect, translated explicitly (:mod:`.dialect`).

Output: arch ``qwen35-dflash-draft`` with every key the loader requires (family, row alignment,
taps, mask id, block size, θ, YaRN, sliding and causal patterns, logit transforms, family heads).
Storage: norms, conv base kernels and the confidence head F32; every other (2-D) tensor in
``--outtype`` (f16 default; bf16, f32, or q8_0 where ne0 % 32 == 0, F16 otherwise). The file is
written atomically. Errors (exit status 1) name the file and the key or tensor at fault.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from .contract import ARCH, DrafterFormatError, K, key, TensorSpec, expected_tensors, q8_0_eligible, tensor_sort_key
from .gguf_meta import write_gguf_atomic
from .hf_config import read_hf_drafter
from .hparams import DrafterHParams
from .safetensors_io import open_checkpoint

OUTTYPES = ("f16", "bf16", "f32", "q8_0")
FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
              "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
F16_MAX = 65504.0


def encode_tensor(name: str, values: np.ndarray, spec: TensorSpec, outtype: str) -> tuple[np.ndarray, QT]:
    """Encode float32 ``values`` (numpy order, i.e. reversed ``spec.ne``) for the GGUF writer.

    NORM / F32_ONLY tensors are always F32. MATRIX tensors use ``outtype``; q8_0 falls back to F16
    when ne0 is not a multiple of 32. Returns (array to write, ggml type). Raises
    DrafterFormatError when a value is not finite, or does not fit F16 (|w| > 65504).
    """
    if not np.all(np.isfinite(values)):
        raise DrafterFormatError(f"tensor {name} holds NaN or inf values")
    t = outtype if spec.kind == "matrix" else "f32"
    if t == "q8_0" and not q8_0_eligible(spec):
        t = "f16"
    if t == "f32":
        return np.ascontiguousarray(values, dtype=np.float32), QT.F32
    if t == "f16":
        peak = float(np.max(np.abs(values))) if values.size else 0.0
        if peak > F16_MAX:
            raise DrafterFormatError(f"tensor {name} has |w| = {peak:g} > 65504, which F16 cannot hold; "
                                     "use --outtype bf16 or f32")
        return values.astype(np.float16), QT.F16
    if t == "bf16":
        return gguf.quants.quantize(np.ascontiguousarray(values, dtype=np.float32), QT.BF16), QT.BF16
    return gguf.quants.quantize(np.ascontiguousarray(values, dtype=np.float32), QT.Q8_0), QT.Q8_0


def add_tensor(writer: gguf.GGUFWriter, name: str, data: np.ndarray, qtype: QT) -> None:
    """Add an encoded tensor (F32/F16 arrays carry their own type; block formats and BF16 are raw)."""
    if qtype in (QT.F32, QT.F16):
        writer.add_tensor(name, data)
    else:
        writer.add_tensor(name, data, raw_dtype=qtype)


def write_drafter_metadata(writer: gguf.GGUFWriter, hp: DrafterHParams, name: str, outtype: str,
                           config: dict) -> None:
    """Every metadata key of a draft GGUF (arch ``qwen35-dflash-draft``): ``general.name`` = ``name``,
    the file type of ``outtype`` (one of OUTTYPES; KeyError otherwise), the contract keys of ``hp``
    and the source ``config`` (a JSON-serialisable dict) as provenance."""
    writer.add_name(name)
    writer.add_type("model")
    writer.add_file_type(FILE_TYPES[outtype])
    if outtype == "q8_0":
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    hp.write_gguf_kv(writer, ARCH)
    writer.add_string(key(ARCH, K.SOURCE_CONFIG_JSON), json.dumps(config, sort_keys=True))


def convert_hf(src: str | os.PathLike, out: str | os.PathLike, outtype: str = "f16",
               log: Callable[[str], None] = print) -> DrafterHParams:
    """Convert the HF drafter at ``src`` to the draft GGUF ``out``; return its hyper-parameters.

    Raises DrafterFormatError for any contract violation (see :func:`.hf_config.read_hf_drafter`)
    and for non-finite or F16-overflowing weights. ``out`` is untouched on error.
    """
    if outtype not in OUTTYPES:
        raise DrafterFormatError(f"--outtype {outtype!r}: expected one of {OUTTYPES}")
    config_path, tensors = open_checkpoint(src)
    d = read_hf_drafter(config_path, tensors)
    hp = d.hparams
    expected = expected_tensors(hp)
    for note in d.notes:
        log(f"  {note}")
    log(f"  {hp.summary()}")
    counts: dict[str, int] = {}

    def fill(writer: gguf.GGUFWriter) -> None:
        write_drafter_metadata(writer, hp, Path(src).name if Path(src).is_dir() else Path(src).parent.name,
                               outtype, d.config)
        for g in sorted(expected, key=tensor_sort_key):
            values = tensors[d.gguf_to_hf[g]].read_f32()
            if g == "dflash.dspark.confidence.bias":
                values = values.reshape(1)
            data, qtype = encode_tensor(g, values, expected[g], outtype)
            add_tensor(writer, g, data, qtype)
            counts[qtype.name] = counts.get(qtype.name, 0) + 1

    write_gguf_atomic(out, ARCH, fill)
    size = Path(out).stat().st_size
    log(f"  wrote {out}: {sum(counts.values())} tensors ("
        + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + f"), {size:,} bytes")
    return hp


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``specd convert-drafter`` (coordinator/cli.py COMMANDS table)."""
    parser.add_argument("src", help="HF drafter folder, a model.safetensors with config.json beside it, "
                        "or a mainline-llama.cpp 'dflash' GGUF to translate")
    parser.add_argument("out", help="output draft GGUF (arch qwen35-dflash-draft)")
    parser.add_argument("--outtype", choices=OUTTYPES, default="f16",
                        help="storage of 2-D weights (norms, conv base kernels, confidence head stay F32)")
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")
    g = parser.add_argument_group("translating a mainline 'dflash' GGUF (C15)")
    g.add_argument("--tap-offset", type=int, choices=(0, 1), default=None,
                   help="convention of dflash.target_layers in the source: 1 = stored +1 (what llama.cpp's "
                        "convert_hf_to_gguf.py writes), 0 = already 0-based output ids. Required: never guessed")
    g.add_argument("--mask-token-id", type=int, default=None,
                   help="mask id when the source carries none (tokenizer.ggml.mask_token_id / dflash.mask_token_id)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="target vocabulary size when the source carries no vocabulary size")
    g.add_argument("--row-alignment", choices=("seed_then_proposals", "proposals_only"), default=None,
                   help="slot convention of a DSpark head (the mainline dialect does not record it)")


def run(args: argparse.Namespace) -> int:
    """Run ``specd convert-drafter``: 0 on success, 1 on a contract error (message on stderr)."""
    src, out = Path(args.src), Path(args.out)
    if out.exists() and not args.force:
        print(f"specd convert-drafter: {out} exists (pass --force to replace it)", file=sys.stderr)
        return 1
    try:
        if src.is_file() and src.suffix == ".gguf":
            from .dialect import translate_mainline

            print(f"translating {src} (mainline 'dflash' dialect) -> {out}")
            translate_mainline(src, out, tap_offset=args.tap_offset, mask_token_id=args.mask_token_id,
                               vocab_size=args.vocab_size, row_alignment=args.row_alignment)
        else:
            print(f"converting {src} -> {out} ({args.outtype})")
            convert_hf(src, out, args.outtype)
    except DrafterFormatError as exc:
        print(f"specd convert-drafter: error: {exc}", file=sys.stderr)
        return 1
    return 0
