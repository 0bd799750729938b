"""Mistral's Tekken vocabulary (NeMo's; Small 3.x, Devstral and Ministral 3 use its kind) in a
GGUF as llama.cpp's converter writes it (`tokenizer.ggml.pre = "tekken"`: byte-level BPE that
looks whole words up first) tokenizes as Mistral's own tokenizer: tiktoken over the same ranks
with the same pattern, which is what mistral-common's Tekkenizer runs. The vocabulary is the
one mistral-common ships (its wheel, sha256-pinned)."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import tiktoken
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine.tokenizer import Tokenizer, load_tokenizer
from tests.tokenizer.tekken import Tekken, load_tekken


@pytest.fixture(scope="module")
def tekken(tandem_home: Path) -> Tekken:
    return load_tekken(tandem_home)


@pytest.fixture(scope="module")
def reference(tekken: Tekken) -> tiktoken.Encoding:
    return tekken.reference()


@pytest.fixture(scope="module")
def tekken_gguf(tekken: Tekken, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tekken") / "tekken-vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    tekken.add_to(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def ours(tekken_gguf: Path) -> Tokenizer:
    return load_tokenizer(tekken_gguf)


CASES = [
    "Hello world! How's it going?",
    "HTTPServer getURL XMLHttpRequest",
    "2024-12-05: 3.14159 and 1,000,000",
    "def f(x):\n    return x  # done\n\n\n",
    "path/to/file.py\r\n  /usr/bin//",
    "Ça va? Über straße — naïve café",
    "日本語のテキスト、中文文本。한국어 텍스트",
    "emoji 😀🎉👍🏽 and ∑∫√ symbols",
    "   leading and trailing spaces   ",
    "tabs\tand\n\nnew\n lines\u00a0nbsp",
    "[INST] special text stays text </s>",
]


@pytest.mark.parametrize("text", CASES)
def test_tekken_tokenizes_as_mistrals_own(
    ours: Tokenizer, reference: tiktoken.Encoding, text: str
) -> None:
    expected = [
        1000 + i for i in reference.encode(text, disallowed_special=())
    ]  # after its specials
    assert ours.encode(text, allow_special=False) == expected
    assert ours.decode(expected) == text


@settings(max_examples=300, deadline=None)
@given(st.text(st.characters(codec="utf-8"), max_size=60))
@example("aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa")
@example("\n\n\n   \t\n")
def test_any_text_tokenizes_as_mistrals_own(
    ours: Tokenizer, reference: tiktoken.Encoding, text: str
) -> None:
    expected = [1000 + i for i in reference.encode(text, disallowed_special=())]
    assert ours.encode(text, allow_special=False) == expected


def test_a_tekken_vocabulary_opens_with_bos_and_knows_its_control_tokens(ours: Tokenizer) -> None:
    assert ours.add_bos and ours.bos_token_id == 1  # as llama.cpp reads a Tekken vocabulary
    ids = ours.encode("[INST]Hi[/INST]", allow_special=True)
    assert ids[0] == 3 and ids[-1] == 4 and len(ids) == 3  # [INST], Hi, [/INST]
    assert ours.special_id("[TOOL_CALLS]") == 9 and ours.is_special(9)
