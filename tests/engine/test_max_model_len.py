"""`max_model_len` (`--max-model-len`): an engine that serves a shorter context than its model's,
and refuses a length outside [2, the model's context] by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.batch import SeqInput
from engine.engine import Engine
from engine.errors import InvalidRequest
from tests.engine.conftest import write_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-context")
    write_tiny_checkpoint(folder, seed=3)
    return folder


def test_a_shorter_context_is_served_and_held(tiny_folder: Path) -> None:
    full = Engine.from_path(tiny_folder, kv_cache_bytes=1 << 20, progress=False)
    short = Engine.from_path(tiny_folder, kv_cache_bytes=1 << 20, progress=False, max_model_len=24)
    assert short.config.max_seq_len == 24 < full.config.max_seq_len
    table = list(range(4))
    short.step([SeqInput("fits", list(range(1, 24)), 0, table)])  # 23 tokens and one to come
    with pytest.raises(InvalidRequest, match="beyond the model's context of 24"):
        short.step([SeqInput("long", list(range(1, 26)), 0, table)])
    full.step([SeqInput("long", list(range(1, 26)), 0, table)])


@pytest.mark.parametrize("length", [1, 10**6])
def test_a_context_outside_the_models_is_refused_by_name(tiny_folder: Path, length: int) -> None:
    with pytest.raises(InvalidRequest, match=r"max_model_len: must be in \[2, "):
        Engine.from_path(tiny_folder, kv_cache_bytes=1 << 20, progress=False, max_model_len=length)
