#!/usr/bin/env bash
# Nsight Compute on the attention kernels of a decode and of an 8-row chain / tree verify over a long KV
# cache (issue 7: what bounds the split-K chunk pass and its combine): ncu_probe.sh on
# tools/device/attn_bench.py --probe (each case called once). Runs after gpu_tests.sh / gpu_bench.sh in
# the same device call.
#
# Usage (repository root on the GPU machine):
#     OUT=/some/dir CONTEXTS=32768 bash tools/device/attn_ncu.sh
# Outputs: ncu_attn.txt (the full report) and a summary appended to status.txt.
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
NAME=attn KERNELS=regex:attn_ exec bash "$here/ncu_probe.sh" python3 "$here/attn_bench.py" --out /tmp/attn_ncu --probe \
  --contexts ${CONTEXTS:-32768}
