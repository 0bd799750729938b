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

# The CPU image and the real compose deployment (`make image`, `make deploy-test`). Here Debian's
# client at /usr/bin/docker is the one with BuildKit built in (../shared/docker/setup.sh).
DOCKER ?= $(if $(wildcard /usr/bin/docker),/usr/bin/docker,docker)
IMAGE ?= tandem:cpu
DOCKER_BUILD_FLAGS ?= --network host
# The CPU torch wheel of TORCH_SPEC's version for the image's Python (3.11), where pip already
# has it on disk (its find-links folders, as on our machines); else the image takes torch from
# PyTorch's CPU index.
FIND_LINKS = $(PIP_FIND_LINKS) $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)
IMAGE_TORCH_WHEEL ?= $(firstword $(wildcard $(addsuffix /torch-$(patsubst torch==%,%,$(firstword \
	$(TORCH_SPEC)))+cpu-cp311-*.whl,$(sort $(FIND_LINKS)))))

.PHONY: setup run test lint bench protos clean image deploy-test

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
# streamed demo request, then serving (gRPC on 127.0.0.1:50051, HTTP on :8000) until Ctrl-C.
run: setup
	$(VENV)/bin/tandem serve --demo "Write a haiku about shared memory."

# The layer rules (import-linter's contracts in pyproject.toml), then the suite.
test: setup
	$(VENV)/bin/lint-imports
	$(VENV)/bin/pytest $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Where a local wheel is used it is linked into .whl/ (git ignores it), the one folder of the
# build context the Dockerfile's `torch-wheels` stage reads.
image:
	@mkdir -p .whl
	$(if $(IMAGE_TORCH_WHEEL),ln -f $(IMAGE_TORCH_WHEEL) .whl/ 2>/dev/null \
		|| cp -f $(IMAGE_TORCH_WHEEL) .whl/)
	DOCKER_BUILDKIT=1 $(DOCKER) build $(DOCKER_BUILD_FLAGS) -f deploy/Dockerfile -t $(IMAGE) \
		$(if $(IMAGE_TORCH_WHEEL),--build-arg TORCH_SOURCE=wheels \
			--build-arg TORCH_SPEC=/wheels/$(notdir $(IMAGE_TORCH_WHEEL))) .
	@$(DOCKER) image ls $(IMAGE)

# The compose deployment for real (tests/deploy/run_compose.py says what it checks).
deploy-test: setup image
	$(PY) -m tests.deploy.run_compose --docker $(DOCKER) --image $(IMAGE)

bench: setup
	$(PY) -m bench.engine

clean:
	rm -rf $(VENV) build *.egg-info tandem/v1 tandem/internal $(GENERATED)
