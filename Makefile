# Everything installs into .venv/. `make install` is idempotent: it re-runs pip only when
# pyproject.toml changed since the last successful install.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU build by default; a CUDA user sets e.g. TORCH_SPEC="torch==2.13.0" with their own index.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# gRPC stubs of protos/ (ssd/transport/grpc_channel.py): generated, never edited, never committed.
# The -I mapping names the proto as if it lived in the package, so the generated *_pb2_grpc.py
# imports its *_pb2.py as ssd.transport._proto.ssd_draft_pb2.
PROTO_PKG := ssd/transport/_proto
PROTOC := $(BIN)/python -m grpc_tools.protoc -I$(PROTO_PKG)=protos --python_out=. --grpc_python_out=.
# The public API's stubs (serve_app/grpc_api.py and Serve's gRPC proxy), the same way.
SERVE_PROTO_PKG := serve_app/_proto
SERVE_PROTOC := $(BIN)/python -m grpc_tools.protoc -I$(SERVE_PROTO_PKG)=protos --python_out=. --grpc_python_out=.

.PHONY: install protos serve test lint format bench loadtest demo-models clean

install: $(STAMP) $(PROTO_PKG)/ssd_draft_pb2_grpc.py $(SERVE_PROTO_PKG)/ssd_serve_pb2_grpc.py

$(STAMP): pyproject.toml protos/ssd_draft.proto protos/ssd_serve.proto
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	$(PROTOC) protos/ssd_draft.proto
	$(SERVE_PROTOC) protos/ssd_serve.proto
	touch $(STAMP)

# Stubs deleted or older than the proto (e.g. after a git clean) with the venv still installed.
$(PROTO_PKG)/ssd_draft_pb2_grpc.py: protos/ssd_draft.proto | $(STAMP)
	$(PROTOC) protos/ssd_draft.proto

$(SERVE_PROTO_PKG)/ssd_serve_pb2_grpc.py: protos/ssd_serve.proto | $(STAMP)
	$(SERVE_PROTOC) protos/ssd_serve.proto

protos:
	$(PROTOC) protos/ssd_draft.proto
	$(SERVE_PROTOC) protos/ssd_serve.proto

serve: install
	$(BIN)/ssd serve

test: install
	$(BIN)/python -m pytest -q --durations=25

# The linter and the formatter's check, as CI runs them before the tests; `make format` rewrites.
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: install
	$(BIN)/ssd bench

# Against a running `make serve` (another terminal): 4 users for 60 s, every speculation mode the
# server serves (its /v1/models card lists them: auto and ar by default), reports in
# bench_results/loadtest_*.csv and bench_results/loadtest.html. The requests in flight at the end
# finish and are counted (--stop-timeout), not cut off.
loadtest: install
	mkdir -p bench_results
	$(BIN)/locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless -u 4 -r 4 -t 60s \
		--stop-timeout 60 --csv bench_results/loadtest --html bench_results/loadtest.html

demo-models: install
	$(BIN)/ssd build-demo-models

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
