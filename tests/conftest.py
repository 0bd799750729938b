"""Fixtures shared by every layer's tests: the cached model files, an address nothing listens
on, an OTLP receiver, GPU skipping, pinned random numbers, and the Hypothesis profiles.

Property tests are reproducible by default: the "ci" profile derandomizes Hypothesis (the
examples follow from each test's own code) and keeps no example database, so every run of
`make test` tests the same inputs. `pytest --hypothesis-profile=explore` searches afresh with
more examples; what it finds belongs in the test as an `@example`."""

from __future__ import annotations

import os
import random
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from engine import registry
from tests.telemetry.otlp_receiver import OtlpReceiver

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", max_examples=1000)
settings.load_profile("ci")


def _seed() -> None:
    random.seed(0)
    if (np := sys.modules.get("numpy")) is not None:  # seeded where a test module imported it
        np.random.seed(0)
    if (torch := sys.modules.get("torch")) is not None:
        torch.manual_seed(0)


# Each test, and each module's fixtures, draw the same random numbers on every run, whichever
# tests ran before: a tolerance met by most random inputs is not met by all of them.
@pytest.fixture(scope="module", autouse=True)
def _pinned_random_numbers_of_the_module() -> None:
    _seed()


@pytest.fixture(autouse=True)
def _pinned_random_numbers() -> None:
    _seed()


def _home() -> Path:
    return Path(os.environ.get("TANDEM_HOME", "~/.cache/tandem")).expanduser()


@pytest.fixture(scope="session")
def tandem_home() -> Path:
    return _home()


@pytest.fixture(scope="session")
def default_gguf(tandem_home: Path) -> Path:
    """The default model's GGUF (SmolLM2-135M-Instruct, Q4_1), fetched once into the cache."""
    return registry.fetch(registry.lookup(registry.DEFAULT_MODEL), tandem_home, quiet=True)


@pytest.fixture(scope="session")
def llama3_tokenizer_model(tandem_home: Path) -> Path:
    """The LLaMA-3 tiktoken BPE file `tokenizer.model`."""
    return registry.fetch(registry.lookup("llama3"), tandem_home, quiet=True)


@pytest.fixture
def closed_address() -> str:
    """An address nothing listens on: a port the OS gave out and took back."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    rx = OtlpReceiver().start()
    yield rx
    rx.stop()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # The marker itself: `item.keywords` also holds path parts (a checkout named gpu/).
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
