# flatflower: `make demo` and `make test` create and use .venv when no virtualenv is active.
SHELL := /bin/bash
PYTHON ?= python3
ifdef VIRTUAL_ENV
  VENV := $(VIRTUAL_ENV)
else
  VENV := $(CURDIR)/.venv
endif
BIN := $(VENV)/bin
STAMP := $(VENV)/.flatflower-installed
export FLWR_DISABLE_UPDATE_CHECK := 1
export FLWR_TELEMETRY_ENABLED := 0

.PHONY: install demo test test-slow test-all test-fast test-docker bench bench-quick bench-gpu clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# A 4-client FedSAM federation on scikit-learn digits over real SuperLink/SuperNode processes.
demo: $(STAMP)
	$(BIN)/flatflower local --algorithm fedsam --clients 4 --rounds 6 --dataset digits --set local-epochs=10 \
		--run-dir runs/demo-$$(date +%Y%m%d-%H%M%S)

# The suite but its long end-to-end tests (marker `slow`): unit, algorithm, in-process, vectorised
# and a loopback deployment, on two workers (measured times: CONTRIBUTING.md, "Tests"). The Ray tests run one
# at a time (their xdist group), deployments side by side on free ports.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=12 -m "not slow" tests

# The long end-to-end tests alone: processes killed and restarted, TLS, Ray, whole CLI runs and
# sweeps (CONTRIBUTING.md, "Tests", has its time). CI runs `make test` and then this.
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=12 -m slow tests

# Both, in one pytest session.
test-all: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=12 tests

# Unit and algorithm tests only (no Flower processes, no Ray).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not integration" tests

# The docker-compose federation of docker/, run for real (docs/deployment.md, "Tested end to
# end"): opt-in, as root; installs and starts a Docker engine if none answers, builds the images
# (local stand-ins for Flower's when Docker Hub is out of reach), runs the plain, TLS and restart
# scenarios, and removes every container, network and volume it made. Not part of `make test`.
test-docker: $(STAMP)
	$(BIN)/python tests/docker_e2e.py $(ARGS)

# Benchmarks (docs/benchmarks.md): timings are reported, never asserted.
bench: $(STAMP)
	$(BIN)/flatflower bench --full --out bench.json

bench-quick: $(STAMP)
	$(BIN)/flatflower bench --quick --out bench-quick.json

# issue 45's GPU figures (docs/benchmarks.md, "One GPU: the prepared benchmark"); no CUDA: one line, exit 0
bench-gpu: $(STAMP)
	PY=$(BIN)/python bash docs/results/run_gpu_bench.sh

clean:
	rm -rf .pytest_cache build *.egg-info
