"""The `specd` command line.

Each subcommand lives with the component that owns it; this table only names them. A command
module provides ``add_arguments(parser)`` and ``run(args) -> int`` and is imported lazily, so
`specd --help` stays fast and a command's dependencies load only when it runs.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# gRPC's EventEngine TCP client and listener (grpcio's default) pass every socket read and write
# between their own poller / pool threads and the thread that polls the completion queue; the iomgr
# stack they replace does the socket I/O on the polling thread itself. On the spec loop's worker hops
# (one small message each way per step) that halves gRPC's CPU time per message on both sides and
# cuts the round trip by a third (BENCHMARKS.md, "Spec loop on the CPU: per-call overhead"). grpc
# reads the variable once, when it is imported, so main() sets it before any command module loads;
# the children `specd serve` starts inherit it, and a GRPC_EXPERIMENTS already set is kept.
GRPC_EXPERIMENTS = "-event_engine_client,-event_engine_listener"

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "convert-target": ("specd.target_worker.convert", "convert a transformers Qwen3.5 checkpoint to a qwen35 GGUF"),
    "perplexity": ("specd.target_worker.perplexity", "llama.cpp-style perplexity of a target GGUF over a text file"),
    "convert-drafter": ("specd.draft_worker.convert", "convert a DFlash / DSpark / DFlash 2 checkpoint to a drafter GGUF"),
    "quantize-drafter": ("specd.draft_worker.quantize", "quantize a drafter GGUF (2-D weights to Q8_0)"),
    "serve": ("specd.coordinator.launcher", "start target worker, drafter worker and coordinator together"),
    "coordinator": ("specd.coordinator.app", "run the public gRPC server (spec loop) alone"),
    "target-worker": ("specd.target_worker.server", "run the target worker gRPC server alone"),
    "draft-worker": ("specd.draft_worker.server", "run the drafter worker gRPC server alone"),
    "generate": ("specd.coordinator.client", "stream a completion from a running server and print stats"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specd", description="Lossless speculative decoding for qwen35 models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        try:
            importlib.import_module(module).add_arguments(p)
        except ModuleNotFoundError as exc:  # a component not installed in this build
            p.set_defaults(_missing=str(exc))
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS)
    args = build_parser().parse_args(argv)
    if getattr(args, "_missing", None):
        print(f"specd {args.command}: unavailable ({args._missing})", file=sys.stderr)
        return 2
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except (ValueError, OSError) as exc:  # bad input or files: one clear line, no traceback
        print(f"specd {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
