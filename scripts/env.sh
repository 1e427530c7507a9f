#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment and print its python.
# Idempotent: when the environment exists and pyproject.toml is unchanged, it
# does nothing but print the path. Location: $MPFUNC_VENV, default
# ~/.cache/mpfunc/venv, outside the clone so that fresh clones on the same
# machine (CI) reuse the ~7 GB torch + torch_xla install.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MPFUNC_VENV:-$HOME/.cache/mpfunc/venv}"
py_base="$(command -v python3.11 || command -v python3)"
if [[ ! -x "$venv/bin/python" ]]; then
  echo "mpfunc: creating $venv with $py_base" >&2
  "$py_base" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip setuptools wheel >&2
fi
stamp="$venv/.mpfunc-stamp"
want="$(cat "$repo/pyproject.toml" | sha256sum | cut -d' ' -f1) $repo"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
  echo "mpfunc: installing mpfunc[xla,test,bench] into $venv (first time: several GB)" >&2
  "$venv/bin/python" -m pip install -q --no-build-isolation -e "$repo[xla,test,bench]" >&2
  echo "$want" > "$stamp"
fi
echo "$venv/bin/python"
