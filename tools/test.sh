#!/usr/bin/env bash
# The README's test command: sets up a virtualenv with specd and the test oracles, then runs pytest.
# Extra arguments go to pytest (e.g. tools/test.sh -k norm); with a test path among them
# (tools/test.sh tests/demo/test_demo_target.py, or a file::test id) pytest runs that instead of tests/.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SPECD_VENV:-$root/.venv}"
"$root/tools/setup_env.sh" test
cd "$root"
export SPECD_MLX_PYTHON="$venv-mlx/bin/python"  # the DSpark oracle interpreter (tools/setup_env.sh)
targets=(tests)
for arg in "$@"; do
  if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then targets=(); break; fi
done
set +e
"$venv/bin/python" -m pytest -q -rs ${targets[@]+"${targets[@]}"} "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  # pytest's "no tests collected": a broken collection, never a pass.
  echo "specd tests: pytest collected no tests" >&2
  exit 1
fi
exit $rc
