"""Fixtures shared by every layer's tests: the cached model files, and GPU skipping."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine import registry


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
        if "gpu" in item.keywords:
            item.add_marker(skip)
