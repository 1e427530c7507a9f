#!/usr/bin/env bash
# Set up the environment if needed, then run the seed benchmark (the main job)
# on every available device. Results go to a folder under the system's temporary
# directory (printed at the end) unless --out is given; refresh the committed
# results on purpose with --out bench/results/seed.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
py="$(bash scripts/env.sh)"
export PJRT_DEVICE="${PJRT_DEVICE:-CPU}"
exec "$py" -m bench.seed "$@"
