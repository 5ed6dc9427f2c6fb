#!/usr/bin/env bash
# `make gpu-check`: what a CUDA GPU changes in this project, in one run of about 8 minutes, on the
# lent GPU machine as it is: it reaches no package registry and has no Ray, so nothing is
# installed and nothing imports Ray. It runs the machine's python3 (.venv/bin/python where the
# checkout has one, or $PYTHON) on this checkout, with the wheels ../shared/gpu/pack.sh packed into
# .gpu/ (GPU_CHECK_WHEELS) unpacked offline (pip --no-index, into GPU_CHECK_SITE) first on PYTHONPATH:
#   1. the engine tests on CUDA: tests/test_models.py and tests/test_batch.py (UNIUN_TEST_DEVICE),
#      without tests/conftest.py, which imports Ray; within GPU_CHECK_TESTS_S;
#   2. benchmarks/gpu_bench.py within what is left of GPU_CHECK_BUDGET (its plan trimmed to fit).
# Writes gpu-check.md, into $OUT where set (with results/gpu_bench-gpu.json, the record that
# `benchmarks/render.py` puts in BENCHMARKS.md once copied to benchmarks/results/, and the bench's
# progress JSON); else the record goes to benchmarks/results/.
# GPU_CHECK_DEVICE=cpu: the same on a CPU with a tiny shape (how the script is tried without a GPU).
# GPU_CHECK_FULL=1 (`make gpu-check-full`: a GPU workstation with the venv and Ray): then also the
# runtime tests with the ModelActor on the GPU, the vLLM engine and the other benchmarks.
set -uo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
out_dir=${OUT:-.}
out=${GPU_CHECK_OUT:-$out_dir/gpu-check.md}
device=${GPU_CHECK_DEVICE:-cuda}
budget=${GPU_CHECK_BUDGET:-480}
tests_s=${GPU_CHECK_TESTS_S:-150}
if [ -n "${PYTHON:-}" ]; then python=$PYTHON; elif [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
if [ "$device" = cpu ]; then
  bench_args=${GPU_BENCH_ARGS:---shapes tiny --tokenizer tiny --rows 1,2 --anchor-rows 1 --prompt-tokens 16 --new-tokens 8 --chat-rows 2 --chat-tokens 4}
else
  bench_args=${GPU_BENCH_ARGS:-}
fi

site_packages() {  # the carried wheels, unpacked offline; one at a time where some do not fit this Python
  local wheels=${GPU_CHECK_WHEELS:-.gpu/whl} site=${GPU_CHECK_SITE:-/tmp/uniun-gpu-site} pip=("$python" -m pip install -q --no-index --no-deps
    --no-compile --no-cache-dir --disable-pip-version-check --upgrade --target)
  compgen -G "$wheels/*.whl" > /dev/null || return 0
  if ! "${pip[@]}" "$site" "$wheels"/*.whl > /dev/null 2>&1; then
    for wheel in "$wheels"/*.whl; do
      "${pip[@]}" "$site" "$wheel" > /dev/null 2>&1 || echo "gpu-check: $wheel does not install on $python" >&2
    done
  fi
  echo "$site:"
}
export PYTHONPATH="$(site_packages)$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
export USE_HUB_KERNELS=${USE_HUB_KERNELS:-0}   # belt and braces: the project loads with use_kernels=False itself (issue 35; its test unsets this)
[ -n "${OUT:-}" ] && export BENCH_RESULTS=$out_dir/results
export GPU_CHECK_NOTE=${GPU_CHECK_NOTE:-make gpu-check}   # the record's note: how it ran

status=0
step() {  # step TITLE COMMAND...: run it, its output into the file under a heading
  echo "== $1"
  { echo; echo "## $1"; echo; echo '```'; echo "\$ ${*:2}"; } >> "$out"
  "${@:2}" 2>&1 | grep --line-buffered -v -E "^Loading weights|^Writing model shards|it/s\]$" | tee -a "$out"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  echo '```' >> "$out"
}
{
  echo "# gpu-check, $(date -u +%Y-%m-%dT%H:%MZ), $(git rev-parse --short HEAD 2> /dev/null || echo 'no git')"
  echo
  [ "$device" = cuda ] && { nvidia-smi -L 2> /dev/null || echo "(no nvidia-smi)"; }
} > "$out"
if ! "$python" - "$device" >> "$out" <<'EOF'
import platform, sys, torch, transformers
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "transformers", transformers.__version__)
sys.exit(sys.argv[1] == "cuda" and not torch.cuda.is_available())
EOF
then
  echo "gpu-check: torch sees no CUDA GPU here; run it on a GPU machine (GPU_CHECK_DEVICE=cpu tries it on a CPU)" >&2
  exit 2
fi
step "engine tests on $device" timeout "$tests_s" env UNIUN_TEST_DEVICE="$device" "$python" -m pytest --noconftest -q \
  -p no:cacheprovider tests/test_models.py tests/test_batch.py ${GPU_CHECK_PYTEST_ARGS:-}
# issue 35: its CUDA checks are in the engine tests above (no Hub kernels at load, the seeded draws,
# the KV budget, one greedy answer); here what the probe reads on the device
step "engine probe on $device (issue 35): step profile, spread, tokens/s and slots auto of tiny" "$python" -c \
  "import json; from uniun_ray.models import Engine; e = Engine(device='$device'); e.load('tiny'); print(json.dumps(e.describe()['probe'], indent=1))"
left=$((budget - (SECONDS - started) - 10))
# shellcheck disable=SC2086  # the bench's arguments are words
step "the GPU benchmark (issue 36), within ${left} s" timeout --signal=TERM "$((left + 60))" \
  "$python" benchmarks/gpu_bench.py --device "$device" --budget "$left" $bench_args
if [ "${GPU_CHECK_FULL:-0}" = 1 ]; then
  step "runtime tests, the ModelActor on the GPU" "$python" -m pytest -q -p no:cacheprovider tests/test_runtime.py tests/test_runtime_slots.py
  step "slots on the GPU: 32 background streams at slots auto against slots 1, a chat beside full slots (goal >= 10x)" \
    "$python" benchmarks/slots_bench.py --streams 32 --window 30
  step "engine benchmark" "$python" benchmarks/engine_bench.py --device cuda --trials 5
  step "batched decode benchmark (issue 25)" "$python" benchmarks/batch_bench.py --device cuda --dtype auto --sizes 1,2,4,8,16,32
  step "prefix cache benchmark (two KV tiers on the GPU)" "$python" benchmarks/kv_cache_bench.py
  step "runtime benchmark" "$python" benchmarks/runtime_bench.py --repeat 3
  step "step profile: a batched decode step by batch size (the simulator's gpu curve)" \
    "$python" benchmarks/step_profile.py --device cuda --dtype bfloat16 --batches 1,2,4,8,16,32,64,128
  step "vLLM engine: install, runtime scenarios on CUDA" make test-vllm
  step "vLLM engine benchmark (start, step profile, revoke-to-stop, a token, resume)" \
    "$python" benchmarks/vllm_engine.py --slots 8
  step "BENCHMARKS.md from the records" "$python" benchmarks/render.py
fi
echo "gpu-check: $((SECONDS - started)) s, tables in $out (exit $status)" | tee -a "$out"
exit $status
