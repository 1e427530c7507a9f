#!/usr/bin/env bash
# Set up the environment if needed, then run lint, type checks and the whole
# test suite on the CPU and on the XLA CPU backend (PJRT_DEVICE=CPU).
# XLA tests are required: a missing torch_xla is a failure, not a skip.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
py="$(bash scripts/env.sh)"
bin="$(dirname "$py")"
echo "== ruff"; "$bin/ruff" check mpfunc tests bench examples && "$bin/ruff" format --check mpfunc tests bench examples
echo "== mypy"; "$bin/mypy"
echo "== pytest"
export PJRT_DEVICE=CPU MPFUNC_REQUIRE_XLA=1
exec "$py" -m pytest "$@"
