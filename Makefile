# Thin wrappers: `make run` and `make test` each build the environment they need first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU installs pin the torch build that CI has on disk; set TORCH_SPEC to bring your own.
TORCH_SPEC ?= torch==2.13.0
MODELS ?= smollm2-135m-instruct llama3
STAMP := $(VENV)/.tandem-installed
PROTOS := $(wildcard protos/tandem/v1/*.proto protos/tandem/internal/v1/*.proto)
GENERATED := tandem/.generated
MODELS_STAMP := $(VENV)/.tandem-models
PYTEST_ARGS ?=

.PHONY: setup run test lint bench protos clean

setup: $(STAMP) $(GENERATED) $(MODELS_STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH_SPEC)
	$(PY) -m pip install -q --disable-pip-version-check -e ".[dev]"
	@touch $(STAMP)

# Python code for the protos, produced by the build and never edited (it is not in git).
protos: $(GENERATED)

$(GENERATED): $(PROTOS) $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
	@touch $(GENERATED)

$(MODELS_STAMP): $(STAMP) $(GENERATED)
	$(VENV)/bin/tandem models fetch $(MODELS)
	@touch $(MODELS_STAMP)

# The main job: the three-process pipeline serving the default model on CPU, answering one
# streamed demo request, then serving on 127.0.0.1:50051 until Ctrl-C.
run: setup
	$(VENV)/bin/tandem serve --demo "Write a haiku about shared memory."

test: setup
	$(VENV)/bin/pytest $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

bench: setup
	$(PY) -m bench.engine

clean:
	rm -rf $(VENV) build *.egg-info tandem/v1 tandem/internal $(GENERATED)
