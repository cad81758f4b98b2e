# Everything installs into .venv/. `make install` is idempotent: it re-runs pip only when
# pyproject.toml changed since the last successful install.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU build by default; a CUDA user sets e.g. TORCH_SPEC="torch==2.13.0" with their own index.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install serve test bench demo-models clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

serve: install
	$(BIN)/ssd generate --prompt "def fibonacci(n):" --max-tokens 128 --mode sd --stream

test: install
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/ssd bench

demo-models: install
	$(BIN)/ssd build-demo-models

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
