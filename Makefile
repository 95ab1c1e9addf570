# Two commands do everything:
#   make train   set up .venv (idempotent) and run the main job: ddiloco train on built-in defaults
#   make test    set up .venv (idempotent) and run the whole test suite
PYTHON ?= python3
VENV   ?= .venv
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0

.PHONY: setup train test bench clean
setup: $(STAMP)

# The pinned CPU build of torch is installed first, so the package's torch>=2.2
# requirement is already met and pip never pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml setup.py src/ddiloco/_kernels.c
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q $(TORCH)
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/ddiloco train $(ARGS)

test: $(STAMP)
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(VENV)/bin/python bench/run_all.py

clean:
	rm -rf $(VENV) runs .pytest_cache
