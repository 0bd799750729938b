"""Incremental detokenization: the streamed deltas add up to a full decode, token by token."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine.errors import InvalidRequest
from engine.tokenizer import Detokenizer, Tokenizer

TEXTS = st.text(
    st.one_of(
        st.characters(),
        st.sampled_from(list("😀👍🏽🇺🇸❤️日本語中文한국어éñ½ \n")),
    ),
    max_size=40,
)


def stream(tokenizer: Tokenizer, ids: list[int], *, skip_special: bool = False) -> list[str]:
    detok = Detokenizer(tokenizer, skip_special=skip_special)
    return [detok.feed(i) for i in ids] + [detok.flush()]


@pytest.fixture(scope="session", params=["smollm", "llama3"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    return request.getfixturevalue(request.param)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_random_ids_stream_to_the_full_decode(tokenizer: Tokenizer, data: st.DataObject) -> None:
    ids = data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=30))
    skip = data.draw(st.booleans())
    assert "".join(stream(tokenizer, ids, skip_special=skip)) == tokenizer.decode(
        ids, skip_special=skip
    )


@settings(max_examples=100, deadline=None)
@given(text=TEXTS)
@example(text="\ud800")  # a lone surrogate: once a TypeError from deep inside `tokenizers`
def test_encoded_text_streams_back_without_replacement_characters(
    tokenizer: Tokenizer, text: str
) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        with pytest.raises(InvalidRequest, match="not valid Unicode"):
            tokenizer.encode(text, allow_special=False)
        return
    ids = tokenizer.encode(text, allow_special=False)
    deltas = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    # SmolLM2's vocabulary cannot spell a few bytes (see test_gguf); the rest must come back.
    if b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode():
        assert "".join(deltas) == text
        if "\ufffd" not in text:
            # Characters split across tokens are held back, never shown half-made.
            assert not any("\ufffd" in d for d in deltas)


def test_an_emoji_split_across_tokens_appears_when_complete(smollm: Tokenizer) -> None:
    ids = smollm.encode("a😀", allow_special=False)
    assert len(ids) >= 3  # "a", then the emoji's four bytes over at least two tokens
    deltas = stream(smollm, ids)
    assert deltas[0] == "a"
    assert all(d == "" for d in deltas[1:-2])
    assert deltas[-2:] == ["😀", ""]


def test_cjk_split_across_tokens(llama3: Tokenizer, smollm: Tokenizer) -> None:
    for tokenizer in (llama3, smollm):
        text = "語彙の分割テスト"
        ids = tokenizer.encode(text, allow_special=False)
        pieces = [tokenizer.token_bytes(i) for i in ids]
        assert any(_incomplete(p) for p in pieces), "want a character split across tokens"
        deltas = stream(tokenizer, ids)
        assert "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas)


def _incomplete(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def _byte_token(tokenizer: Tokenizer, value: bytes) -> int:
    return next(i for i in range(tokenizer.vocab_size) if tokenizer.token_bytes(i) == value)


def test_invalid_bytes_become_replacement_at_once_and_at_flush(llama3: Tokenizer) -> None:
    a = _byte_token(llama3, b"a")
    stray = _byte_token(llama3, b"\x80")  # a continuation byte with nothing to continue
    lead = _byte_token(llama3, b"\xf0")  # starts a four-byte character that never finishes
    detok = Detokenizer(llama3)
    assert detok.feed(a) == "a"
    assert detok.feed(stray) == "\ufffd"
    assert detok.feed(lead) == ""
    assert detok.feed(a) == "\ufffda"
    assert detok.feed(lead) == ""
    assert detok.flush() == "\ufffd"


def test_special_tokens_shown_or_skipped(smollm: Tokenizer) -> None:
    ids = smollm.encode("<|im_start|>assistant\nOui.<|im_end|>", allow_special=True)
    assert "".join(stream(smollm, ids)) == "<|im_start|>assistant\nOui.<|im_end|>"
    assert "".join(stream(smollm, ids, skip_special=True)) == "assistant\nOui."
