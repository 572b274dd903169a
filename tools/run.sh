#!/usr/bin/env bash
# The README's main-job command: installs specd (tools/setup_env.sh), starts the service (target
# worker, drafter worker and coordinator) on its embedded defaults — the demo target and the demo
# DFlash 2 drafter (models/, installed with specd) — on loopback, sends one Generate request, prints
# the streamed text and the speculation stats, and stops the service.
# Extra arguments go to `specd generate` (e.g. --chat "..." --max-tokens 200).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SPECD_VENV:-$root/.venv}"
"$root/tools/setup_env.sh"
specd="$venv/bin/specd"
port="$("$venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
log="$(mktemp)"
"$specd" serve --listen "127.0.0.1:$port" --metrics-port 0 >"$log" 2>&1 &
server=$!
trap 'kill -TERM "$server" 2>/dev/null; wait "$server" 2>/dev/null; rm -f "$log"' EXIT
for _ in $(seq 600); do  # wait for READY (at most 60 s)
  grep -q "^READY" "$log" && break
  kill -0 "$server" 2>/dev/null || { cat "$log" >&2; exit 1; }
  sleep 0.1
done
grep -q "^READY" "$log" || { echo "specd serve did not become ready:" >&2; cat "$log" >&2; exit 1; }
args=("$@")
[[ ${#args[@]} -gt 0 ]] || args=(--prompt $'def read_config(path):\n    """Read a configuration file and' --max-tokens 64)
"$specd" generate --server "127.0.0.1:$port" "${args[@]}"
