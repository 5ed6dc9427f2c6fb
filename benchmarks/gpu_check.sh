#!/usr/bin/env bash
# `make gpu-check`: everything in this project that a CUDA GPU changes, in one run, ready for the
# day a GPU is lent (nothing else in the suite needs CUDA). Writes every table to one file
# (GPU_CHECK_OUT, default gpu-check.md): the engine tests on the GPU, the runtime tests with the
# ModelActor placed on the GPU, the vLLM engine's scenarios, and the engine, prefix-cache, runtime and vLLM benchmarks, whose records
# (benchmarks/results/*-gpu.json, beside the CPU ones) `benchmarks/render.py` puts in BENCHMARKS.md.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
out=${GPU_CHECK_OUT:-gpu-check.md}
if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu-check: torch sees no CUDA GPU here; run it on a GPU machine (make install picks a CUDA torch there)" >&2
  exit 2
fi
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
status=0
step() {  # step TITLE COMMAND...: run it, its output into the file under a heading
  echo "== $1"
  { echo; echo "## $1"; echo; echo '```'; echo "\$ ${*:2}"; } >> "$out"
  "${@:2}" 2>&1 | grep -v -E "^Loading weights|it/s\]$" | tee -a "$out" || status=1
  echo '```' >> "$out"
}
{ echo "# gpu-check, $(date -u +%Y-%m-%dT%H:%MZ)"; echo; nvidia-smi -L; "$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'; } > "$out"
step "engine tests on cuda" env UNIUN_TEST_DEVICE=cuda "$python" -m pytest -q -p no:cacheprovider tests/test_models.py tests/test_batch.py
# issue 35: its CUDA checks are in the engine tests above (no Hub kernels at load, the seeded draws,
# the KV budget, one greedy answer with UNIUN_DETERMINISTIC); here what the probe reads on the GPU
step "engine probe on cuda (issue 35): step profile, spread, tokens/s and slots auto of tiny" "$python" -c \
  'import json; from uniun_ray.models import Engine; e = Engine(device="cuda"); e.load("tiny"); print(json.dumps(e.describe()["probe"], indent=1))'
step "runtime tests, the ModelActor on the GPU" "$python" -m pytest -q -p no:cacheprovider tests/test_runtime.py tests/test_runtime_slots.py
step "slots on the GPU: 32 background streams at slots auto against slots 1, a chat beside full slots (goal >= 10x)" \
  "$python" benchmarks/slots_bench.py --streams 32 --window 30
step "engine benchmark" "$python" benchmarks/engine_bench.py --device cuda --trials 5
step "batched decode benchmark (issue 25)" "$python" benchmarks/batch_bench.py --device cuda --dtype auto --sizes 1,2,4,8,16,32
step "prefix cache benchmark (two KV tiers on the GPU)" "$python" benchmarks/kv_cache_bench.py
step "runtime benchmark" "$python" benchmarks/runtime_bench.py --repeat 3
step "step profile: a batched decode step by batch size (the simulator's gpu curve)" \
  "$python" benchmarks/step_profile.py --device cuda --dtype bfloat16 --batches 1,2,4,8,16,32,64,128
# the vLLM engine (issue 26): its venv once (pip's `vllm`, CUDA), its runtime scenarios, its costs
step "vLLM engine: install, runtime scenarios on CUDA" make test-vllm
step "vLLM engine benchmark (start, step profile, revoke-to-stop, a token, resume)" \
  "$python" benchmarks/vllm_engine.py --slots 8
step "BENCHMARKS.md from the records" "$python" benchmarks/render.py
echo "gpu-check: tables in $out (exit $status)"
exit $status
