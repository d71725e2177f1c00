# Two commands on a fresh machine with Python >= 3.10 and make:
#   make demo    run 2 ranks, trace them, write plots to runs/
#   make test    every test (unit, multi-process, notebooks)
#   make test-fast   the single-process tests only (under 90 s): the loop while editing
# Both create .venv on first use.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CONSTRAINTS ?= constraints.txt
PIP_C := $(if $(CONSTRAINTS),-c $(CONSTRAINTS),)
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: demo lab test test-fast test-gpu-counts labs clean

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(PIP_C) torch
	$(PY) -m pip install -q $(PIP_C) -e ".[lab,test]"
	# FairScale as a test reference only; its own requirements pin an old torch, so no deps
	$(PY) -m pip install -q --no-deps fairscale==0.4.13
	@touch $@

demo: $(VENV)/.installed
	$(PY) -m minifsdp.demo

# Rooted at the repository: the file browser reaches labs/ (exercises, README) and solutions/ (solved).
lab: $(VENV)/.installed
	$(PY) -m jupyter lab --ServerApp.root_dir=. $(ROOT_FLAG)

# Everything in one pytest on two pytest-xdist workers: tests/ and solutions/ under nbval (pyproject's testpaths).
# A quarter of a lone run's time is spent waiting (kernels and torchrun starting, ranks in collectives), which
# the other worker fills. --dist loadfile: each file whole on one worker, so a module's fixtures run once and
# nbval keeps one kernel per notebook across its cells. Files go out slowest kind first (conftest.py), so the
# last ones are quick and neither worker waits long for the other at the end.
test: $(VENV)/.installed
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder

# conftest.py marks what starts processes or kernels; solutions/ (nbval) is all notebook
test-fast: $(VENV)/.installed
	$(PY) -m pytest tests -m "not multiprocess and not notebook"

# every solution notebook as a 1-GPU VM too (make test: 2-GPU under nbval, blank labs as 1-GPU)
test-gpu-counts: $(VENV)/.installed
	MINIFSDP_NB_GPU_COUNTS=1 $(PY) -m pytest tests/test_notebooks.py -k pretend_gpus

labs: $(VENV)/.installed
	$(PY) tools/make_labs.py

clean:
	rm -rf runs/ .pytest_cache
