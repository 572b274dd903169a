#!/usr/bin/env bash
# The README's main-job command: set up specd, start the service on the embedded demo models,
# send one Generate request and print the streamed text and the speculation stats.
set -euo pipefail
echo "specd: not yet available: the service (coordinator + workers) and the embedded demo models" >&2
echo "       land with the service and demo-model issues; until then this command has nothing to run." >&2
exit 1
