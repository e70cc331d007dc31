# `make run`: set up .venv, prepare the built-in corpus, train the quickstart.
# `make check`: lint, format, import layers and types (what CI runs first).
# `make test`: set up .venv, run the whole suite (what CI runs).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
export OMP_NUM_THREADS ?= 1

.PHONY: setup run check test unit bench clean proto

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.txt tools/install.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python tools/install.py
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/lmforge data prepare jobs/quickstart.yaml
	$(BIN)/lmforge train jobs/quickstart.yaml

# ruff (pyproject.toml), import-linter's contracts (.importlinter), pyright on the
# typed boundaries (pyproject.toml); `ruff format platform tests bench tools` fixes the format.
check: $(STAMP)
	$(BIN)/ruff check platform tests bench tools
	$(BIN)/ruff format --check platform tests bench tools
	$(BIN)/lint-imports --no-cache
	$(BIN)/pyright

# The gRPC API's Python modules, from its .proto (checked in; a test says when stale).
proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I platform --python_out=platform --grpc_python_out=platform --pyi_out=platform \
		platform/lmforge/serve/proto/completions.proto

# Ends with the suite's wall time and its 15 slowest tests (tests/suite_timing.py).
# Byte-compiled first: where PYTHONDONTWRITEBYTECODE is set, every Ray worker and
# rank would otherwise compile lmforge's sources again as it starts.
test: $(STAMP)
	$(BIN)/python -m compileall -q platform/lmforge tests
	$(BIN)/python -m pytest tests

unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit

bench: $(STAMP)
	$(BIN)/python bench/overhead.py

clean:
	rm -rf $(VENV) runs .lmforge
