# OctoPipe: `make demo` and `make test` are the whole set-up on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch pinned first, so the editable install below does not resolve a newer one. The pin
	# gets the CPU build where pip's configuration offers it (as on the development machine);
	# elsewhere on Linux, PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu keeps it from
	# pulling the multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,hf]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" bash examples/demo.sh

# the slowest tests named at the end, to keep the suite within its 20 minutes on 2 cores
test: $(STAMP)
	$(PY) -m pytest -q --durations=15

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

bench: $(STAMP)
	$(PY) benchmarks/bench_simulator.py

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis
