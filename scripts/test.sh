#!/usr/bin/env bash
# The project's checks; .ci/run is exactly `bash scripts/test.sh`.
#
#   bash scripts/test.sh                     ruff, mypy, the whole test suite on the CPU and
#                                            the XLA device, then the oldest-versions run
#   bash scripts/test.sh PYTEST_ARGS...      ruff, mypy, then pytest with these arguments only
#   bash scripts/test.sh --oldest [ARGS...]  only the oldest-versions run
#
# Each sets up its environment first if needed (scripts/env.sh: a venv in this clone,
# sharing the heavy packages with other clones). In the full environment the XLA tests
# are required: a missing torch_xla is a failure, not a skip. They run on the device that
# PJRT_DEVICE names when it is set (a TPU host tests on its TPU), else on the CPU.
#
# The oldest-versions run makes pyproject.toml's lower bounds real: the CPU tests that
# are not marked slow, on the oldest Python, torch and optree it claims, without torch_xla.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
smoke=(-m "not xla and not slow" tests)
versions='import sys, importlib.metadata as m
print(", ".join([f"Python {sys.version.split()[0]}"] + [f"{n} {m.version(n)}" for n in sys.argv[1:]]))'

oldest() {
  local py
  py="$(bash scripts/env.sh --oldest)"
  echo "== pytest, oldest versions: $("$py" -c "$versions" torch optree)"
  native "$py"
  env -u MPFUNC_REQUIRE_XLA "$py" -m pytest "$@"
}

# The native CPU kernel (mpfunc/backends/_native.py) compiles on first use, 30 s to 3 min, cached
# per torch version under ~/.cache/mpfunc/native: built here, so that no test pays for it
# and the log says how long it took.
native() {
  echo "== $("$1" -m mpfunc.backends._native)"
}

if [[ "${1:-}" == --oldest ]]; then
  shift
  if (($#)); then oldest "$@"; else oldest "${smoke[@]}"; fi
  exit
fi

py="$(bash scripts/env.sh)"
echo "== ruff"
"$py" -m ruff check mpfunc tests bench examples
"$py" -m ruff format --check mpfunc tests bench examples
echo "== mypy"
"$py" -m mypy
export PJRT_DEVICE="${PJRT_DEVICE:-CPU}" MPFUNC_REQUIRE_XLA=1
native "$py"
echo "== pytest: $("$py" -c "$versions" torch torch_xla optree), PJRT_DEVICE=$PJRT_DEVICE"
if (($#)); then
  exec "$py" -m pytest "$@"
fi
"$py" -m pytest
oldest "${smoke[@]}"
