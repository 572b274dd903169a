#!/usr/bin/env bash
# The README's main-job command: set up specd, start the service on the embedded demo models,
# send one Generate request and print the streamed text and the speculation stats.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/tools/setup_env.sh"
echo "specd: the service (coordinator + workers) and the embedded demo models are not yet available;" >&2
echo "       this command will start them once the service issue lands." >&2
