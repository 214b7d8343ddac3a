# The two set-up commands of the README: `make demo` and `make test`.
# Both create .venv when missing and install cvt (editable) with its test extras.
#   make demo       train (once) and convert the demo model
#   make test       the layer contract, the docs, then every test, the slow ones included (what CI runs)
#   make test-fast  the tests not marked slow (pyproject.toml's markers): under 2 min on 2 cores
#   make docs       the documentation site (docs/, mkdocs.yml) into build/site, offline and strict
#   make bench      the FP8 -> BF16 benchmark
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-fast docs bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# The C kernels are compiled at install: an existing .venv reinstalls when they change.
KERNELS := $(wildcard convert/*.c convert/*.h quant/*.c quant/*.h)

# torch first, pinned to the local CPU build when one is offered (pip's find-links), so that
# resolving the other requirements never pulls a multi-GB CUDA build.
$(STAMP): $(PY) pyproject.toml $(KERNELS)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install "torch==2.13.0" || $(PIP) install "torch>=2.4,<3"
	$(PIP) install -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/cvt demo

# strict: a broken link, an unknown anchor or a page missing from the nav is an error
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir build/site

# One worker per core, each file on one worker (module fixtures built once), one torch thread per
# worker: on 2 cores 1.6x faster than one process with two threads (OpenMP threads of two workers
# would fight for the same cores). Tests that start ranks or subprocesses inherit the one thread.
test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(MAKE) --no-print-directory docs
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n auto --dist loadfile --durations=15

# The edit loop: every module's fast checks (tests/test_layers.py runs the layer contract too).
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" --durations=5

bench: $(STAMP)
	$(PY) bench/fp8_to_bf16.py

clean:
	rm -rf $(VENV) build *.egg-info convert/*.so quant/*.so
