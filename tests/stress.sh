#!/usr/bin/env bash
# `make test-stress`: the runtime tests (marker `ray`, real Ray and real models) as a new machine
# sees them, several times in a row: each run with an empty model cache (so every GGUF is
# converted and every model's dtype measured again) and two CPU-burning processes beside it
# (a busy neighbour). Any red run stops it. RUNS=3 by default; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${RUNS:-3}
python=${PYTHON:-.venv/bin/python}
burners=()
cleanup() { kill "${burners[@]}" 2>/dev/null || true; }
trap cleanup EXIT
# The burners run at niceness 0, as uniun-ray's Ray workers do (`RAY_worker_niceness=0`, see
# runtime/head.py): they compete with every actor as equals, half the CPU each time a test
# needs it. (Under Ray's default of 15 the OS scheduler's weights would give them ~97 % of it.)
for _ in 1 2; do
  "$python" -c 'while True: pass' &
  burners+=($!)
done
for run in $(seq 1 "$runs"); do
  cache=$(mktemp -d -t uniun-stress-cache-XXXXXX)
  started=$(date +%s)
  echo "== stress run $run/$runs: empty UNIUN_CACHE_DIR=$cache, 2 CPU burners, load $(cut -d' ' -f1 /proc/loadavg)"
  if ! UNIUN_CACHE_DIR="$cache" "$python" -m pytest -q -m ray -p no:cacheprovider "$@"; then
    echo "== stress run $run/$runs FAILED after $(( $(date +%s) - started )) s"
    exit 1
  fi
  echo "== stress run $run/$runs green in $(( $(date +%s) - started )) s"
  rm -rf "$cache"
done
echo "== $runs stress runs green"
