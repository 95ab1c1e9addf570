# Two commands do everything:
#   make train   set up .venv (idempotent) and run the main job: ddiloco train on built-in defaults
#   make test    set up .venv (idempotent), lint, type-check, build the docs, run the whole test suite
PYTHON ?= python3
VENV   ?= .venv
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0
# Debian packages some tests drive for real: headless Chromium (dashboard), network namespaces
# and shaped links (iproute2), a one-node Slurm cluster (slurm-wlm, munge), etcd for the
# replicated syncer's election (etcd-server). Installed once, as root, by `make test`;
# elsewhere the tests that need them skip and say so.
APT_PKGS ?= chromium chromium-driver iproute2 slurm-wlm munge etcd-server

.PHONY: setup sysdeps check train test bench clean
setup: $(STAMP)

sysdeps:
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
	  echo "make: not installing$$missing (needs root and apt-get); the tests that use them will skip"; exit 0; fi; \
	echo "make: installing$$missing"; \
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing \
	  || echo "make: apt-get could not install$$missing; the tests that use them will skip"

# The pinned CPU build of torch is installed first, so the package's torch>=2.2
# requirement is already met and pip never pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml setup.py src/ddiloco/_kernels.c
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q $(TORCH)
	$(VENV)/bin/python -m pip install -q -e '.[test,integrations,lint,docs]'
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/ddiloco train $(ARGS)

# Lint, format check, type check and the docs build (strict) first: seconds, not minutes.
check: $(STAMP)
	$(VENV)/bin/ruff check src tests bench examples
	$(VENV)/bin/ruff format --check src tests bench examples
	$(VENV)/bin/mypy
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

test: $(STAMP) sysdeps check
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(VENV)/bin/python bench/run_all.py

clean:
	rm -rf $(VENV) runs .pytest_cache build/site
