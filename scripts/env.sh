#!/usr/bin/env bash
# Set up this clone's Python environment if needed, then print its python.
#
#   bash scripts/env.sh            # full: mpfunc[xla,test,bench] (torch 2.9 + torch_xla 2.9)
#   bash scripts/env.sh --oldest   # the oldest Python, torch and optree pyproject.toml claims
#
# Two layers, so that two clones never test each other's code, yet torch is
# downloaded once per machine, not once per clone:
#
#   base   $MPFUNC_HOME/base/<profile>-py<X.Y>-<hash> (default MPFUNC_HOME=~/.cache/mpfunc):
#          the third-party requirements only, never mpfunc. The hash covers the
#          interpreter and the exact requirement list read from pyproject.toml, so a
#          base is built once (under a lock, several GB), never changed afterwards,
#          and a change of requirements gets a new base.
#   clone  <clone>/.venv (or .venv-oldest; override with MPFUNC_VENV), a few MB: mpfunc
#          installed editable from this clone, and a .pth file that puts the base's
#          site-packages on sys.path after the venv's own.
#
# Interpreter: $MPFUNC_PYTHON, else python3.11, else python3 (full); $MPFUNC_OLDEST_PYTHON,
# else python3.<min> from PATH or pyenv (oldest), where 3.<min> is requires-python's floor.
# Everything but the printed path goes to stderr.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
profile=full
case "${1:-}" in
  "") ;;
  --oldest) profile=oldest ;;
  *) echo "usage: bash scripts/env.sh [--oldest]" >&2; exit 2 ;;
esac
say() { echo "mpfunc: $*" >&2; }
die() { echo "mpfunc: error: $*" >&2; exit 1; }

# --- the interpreter, checked before anything is created -------------------------
floor="$(sed -n 's/^requires-python *= *">= *\([0-9]*\.[0-9]*\)".*/\1/p' "$repo/pyproject.toml")"
[[ -n "$floor" ]] || die "cannot read requires-python = \">=X.Y\" from $repo/pyproject.toml"
runs() { [[ -n "$1" ]] && "$1" -c "" >/dev/null 2>&1; }
if [[ $profile == full ]]; then
  py="${MPFUNC_PYTHON:-}"
  if [[ -z "$py" ]]; then
    for c in python3.11 python3; do
      if runs "$(command -v "$c" || true)"; then py="$(command -v "$c")"; break; fi
    done
  fi
  [[ -n "$py" ]] || die "no python3.11 or python3 on PATH; install Python 3.11 (the version CI uses) or set MPFUNC_PYTHON"
  how="set MPFUNC_PYTHON to a Python >= $floor (CI uses 3.11)"
else
  py="${MPFUNC_OLDEST_PYTHON:-}"
  if [[ -z "$py" ]]; then
    # A pyenv shim named python3.10 exists but fails unless 3.10 is selected: try the
    # command, then pyenv's own install of that version.
    cands=("$(command -v "python$floor" || true)")
    if command -v pyenv >/dev/null 2>&1; then
      for d in "$(pyenv root)/versions/$floor".*; do cands+=("$d/bin/python$floor"); done
    fi
    for c in "${cands[@]}"; do
      if runs "$c"; then py="$c"; break; fi
    done
  fi
  [[ -n "$py" ]] || die "the oldest-versions run needs Python $floor (requires-python's floor) and found none on PATH or in pyenv; install it or set MPFUNC_OLDEST_PYTHON"
  how="set MPFUNC_OLDEST_PYTHON to a Python $floor"
fi
runs "$py" || die "$py does not run; $how"
have="$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if [[ $profile == oldest && "$have" != "$floor" ]]; then
  die "$py is Python $have; the oldest-versions run must use Python $floor (requires-python's floor); $how"
fi
if ! "$py" -c "import sys; sys.exit(sys.version_info[:2] < tuple(map(int, '$floor'.split('.'))))"; then
  die "$py is Python $have; mpfunc needs Python >= $floor (requires-python in pyproject.toml); $how"
fi
"$py" -c "import venv, ensurepip" >/dev/null 2>&1 \
  || die "$py (Python $have) lacks the venv module or ensurepip (on Debian/Ubuntu: apt-get install python$have-venv)"
py="$("$py" -c 'import os, sys; print(os.path.realpath(sys.executable))')"

# --- the requirement list, read from pyproject.toml --------------------------------
# full: build requirements, dependencies and the xla, test and bench extras, as stated.
# oldest: build requirements, every dependency pinned to its ">=" lower bound, numpy
# (torch warns at import without it, and warnings are errors in the tests) and the
# test runner's packages from the test extra, unpinned: they are tools, not claims.
reqs="$("$py" - "$repo/pyproject.toml" "$profile" <<'EOF'
import re, sys
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    try:
        import tomli as tomllib
    except ModuleNotFoundError:
        from pip._vendor import tomli as tomllib  # the copy pip vendors
with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)
build, meta = project["build-system"]["requires"], project["project"]
extras = meta.get("optional-dependencies", {})
if sys.argv[2] == "full":
    reqs = [*build, *meta["dependencies"], *extras["xla"], *extras["test"], *extras["bench"]]
else:
    def name(req):
        return re.match(r"[A-Za-z0-9._-]+", req).group(0).lower().replace("_", "-")
    reqs = list(build)
    for req in meta["dependencies"]:
        low = re.search(r">=\s*([0-9][^,;\s]*)", req)
        if not low:
            sys.exit(f"dependency {req!r} states no >= lower bound for the oldest-versions run to test")
        reqs.append(f"{name(req)}=={low.group(1)}")
    reqs += [r for r in extras["bench"] if name(r) == "numpy"]
    reqs += [r for r in extras["test"] if name(r) in {"pytest", "pytest-timeout", "hypothesis", "tomli"}]
# Keep what applies to this interpreter (markers), so that the hash covers only that;
# without packaging at hand, keep every line and let pip evaluate the markers.
try:
    from packaging.requirements import Requirement
except ModuleNotFoundError:
    try:
        from pip._vendor.packaging.requirements import Requirement
    except ModuleNotFoundError:
        Requirement = None
if Requirement is not None:
    reqs = [r for r in reqs if (m := Requirement(r).marker) is None or m.evaluate()]
print("\n".join(reqs))
EOF
)"
key="$(printf '%s\n' "layout 1" "$profile" "$py" "$("$py" -VV)" "$reqs" | sha256sum | cut -c1-12)"
home="${MPFUNC_HOME:-$HOME/.cache/mpfunc}"
base="$home/base/$profile-py$have-$key"

# --- the shared base: built once, under a lock, by whichever clone needs it first ----
command -v flock >/dev/null || die "flock (util-linux) is needed to share environments between clones"
mkdir -p "$home/base"
exec 9>"$base.lock"
if ! flock -n 9; then
  say "waiting for another clone's setup of $base"
  flock 9
fi
if [[ ! -f "$base/.complete" ]]; then
  t0=$SECONDS
  others="$(find "$home/base" -mindepth 1 -maxdepth 1 -type d -name "$profile-*" ! -path "$base" | tr '\n' ' ')"
  say "building the shared $profile environment (Python $have) in $base"
  say "requirements: ${reqs//$'\n'/, }"
  say "the first build downloads and unpacks several GB (torch's CUDA libraries, which also run on CPU); pip shows each package as it goes"
  rm -rf "$base"
  "$py" -m venv "$base"
  printf '%s\n' "$reqs" > "$base/requirements.txt"
  # A current pip shows a progress bar while it unpacks, too (several minutes here).
  "$base/bin/python" -m pip install --progress-bar on --upgrade pip >&2 \
    || die "upgrading pip in $base failed"
  # pip's bars animate only on a terminal; elsewhere (CI logs) a line every 30 s says
  # that the install goes on, and how far.
  hb=
  if [[ ! -t 2 ]]; then
    (
      trap 'kill "$s" 2>/dev/null; exit 0' TERM
      while :; do
        sleep 30 & s=$!
        wait "$s"
        say "still installing: $((SECONDS - t0)) s, $(du -sh "$base" 2>/dev/null | cut -f1) so far"
      done
    ) >&2 &
    hb=$!
    trap 'kill "$hb" 2>/dev/null || true' EXIT
  fi
  ok=1
  "$base/bin/python" -m pip install --progress-bar on -r "$base/requirements.txt" >&2 || ok=0
  if [[ -n "$hb" ]]; then kill "$hb" 2>/dev/null || true; trap - EXIT; fi
  ((ok)) || die "installing $base failed (see pip's output above); rerun to retry from scratch"
  "$base/bin/python" -m pip freeze > "$base/freeze.txt"
  touch "$base/.complete"
  say "built $base in $((SECONDS - t0)) s ($(du -sh "$base" | cut -f1))"
  if [[ -n "$others" ]]; then
    say "older $profile environments, unused by this clone from now on (remove them when no other clone needs them): $others"
  fi
fi
flock -u 9
touch "$base/.complete"  # the last use, for whoever cleans up $home/base
base_site="$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"

# --- this clone's venv: mpfunc from this clone, everything else from the base --------
if [[ $profile == full ]]; then venv="${MPFUNC_VENV:-$repo/.venv}"; else venv="${MPFUNC_VENV:-$repo/.venv-oldest}"; fi
stamp="$venv/mpfunc-env.txt"
# The stamp doubles as a record that tests read (tests/test_packaging.py).
want="$(printf '%s\n' "layout=1" "profile=$profile" "python=$py" "home=$home" "base=$base" "repo=$repo" \
  "pyproject=$(sha256sum "$repo/pyproject.toml" | cut -d' ' -f1)")"
if [[ ! -x "$venv/bin/python" || ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
  if [[ -e "$venv" && ! -f "$stamp" ]]; then
    die "$venv exists but was not made by scripts/env.sh; remove it, or set MPFUNC_VENV to another path"
  fi
  say "setting up $venv: mpfunc editable from $repo, the rest from $base"
  rm -rf "$venv"
  "$py" -m venv --without-pip "$venv"
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
  # addsitedir, not a bare path, so the base's own .pth files are processed too.
  printf 'import site; site.addsitedir(%s)\n' "'$base_site'" > "$site/_mpfunc_base.pth"
  # The base's commands (pytest, torchrun, ruff, pip, ...) in this venv's bin: scripts
  # rewritten to run on this venv's python, so that an activated .venv sees this clone's
  # mpfunc; binaries (ruff) linked.
  for f in "$base/bin"/*; do
    n="${f##*/}"
    case "$n" in activate* | Activate* | python*) continue ;; esac
    [[ -f "$f" && ! -e "$venv/bin/$n" ]] || continue
    if [[ "$(head -c 2 "$f")" != "#!" ]]; then
      ln -s "$f" "$venv/bin/$n"
    elif [[ "$(head -n 1 "$f")" == "#!$base/bin/python"* ]]; then
      { echo "#!$venv/bin/python"; tail -n +2 "$f"; } > "$venv/bin/$n"
      chmod +x "$venv/bin/$n"
    fi
  done
  # pip and setuptools come from the base; pip installs into the venv that runs it.
  "$venv/bin/python" -m pip install --no-deps --no-build-isolation --progress-bar off -e "$repo" >&2 \
    || die "installing mpfunc from $repo into $venv failed"
  printf '%s\n' "$want" > "$stamp"
fi
echo "$venv/bin/python"
