"""The GGUF tokenizer of the default model (SmolLM2, `tokenizer.ggml.pre = "smollm"`).

transformers' GGUF conversion is the reference only where it applies. It pre-tokenizes with plain
GPT-2 ByteLevel, while SmolLM2 (its tokenizer.json, and llama.cpp's SMOLLM rule) first splits off
every numeric character. So they cut text differently only where whitespace stands right before
a numeric character:
- a run of two or more whitespace characters before it: SmolLM keeps the run whole ("3  8" is
  "3" "  " "8"), transformers gives its last space to the number ("3" " " " 8");
- any whitespace before a non-ASCII numeric (" ½" is " " "½" for SmolLM, one word for
  transformers, and the vocabulary merges that word differently).
(There the ids may still agree: space-tab-space has no merges, so it is three tokens either way.)
A single whitespace before an ASCII digit is cut differently too, but merges the same: SmolLM2's
vocabulary has no merge joining whitespace to a digit (checked below). Everywhere else the ids
must equal transformers', except for the few bytes the vocabulary cannot spell (see
test_unspellable_bytes_are_dropped_as_llama_cpp_does); random text here avoids those.
The differing cases are checked against the SmolLM rule itself: cut the text as SmolLM does
(each numeric character alone, GPT-2's regex between), then let transformers merge each word on
its own, where no pre-tokenizer choice is left to differ.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import ModelFormatError
from engine.gguf_file import GGUFFile
from engine.tokenizer import Tokenizer, gguf_tokenizer
from engine.tokenizer.byte_level import byte_to_char
from engine.tokenizer.hf_backed import LONG_TEXT_CHARS

regex = pytest.importorskip("regex")

GPT2_PATTERN = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)

AGREEING = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's late; they'll say we've won.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n-1) + fib(n-2)\n",
    "    leading spaces\t\ttabs   and   runs     \n\n\n   trailing   ",
    "x1 y22 z333 1st 2nd 3.14 1,000 (42) [7] -5 #3",
    "Total: 12 items, 345 left, 2024-11-30",
    "naïve café résumé — “quotes” …",
    "日本語のテキスト 中文字符 한국어",
    "emoji 😀👍🏽🇺🇸 ❤️",
    "Привет, мир! مرحبا",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
]
DIFFERING = [
    "3  8",
    "Total:  12 items",
    "a\n\n9",
    "x\t\t7",
    "a\n\n\n1",
    " ½ and ² and ٣",
    "version  2024-11-30",
]


def may_differ(text: str) -> bool:
    return any(len(m[1]) > 1 or not m[2].isascii() for m in regex.finditer(r"(\s+)(\p{N})", text))


def smollm_words(text: str) -> list[str]:
    words = []
    for stretch in regex.split(r"(\p{N})", text):
        words += GPT2_PATTERN.findall(stretch) if stretch else []
    return words


def hf_ids(hf: Any, text: str, *, allow_special: bool) -> list[int]:
    encoded = hf(text, add_special_tokens=False, split_special_tokens=not allow_special)
    return list(encoded.input_ids)


def smollm_reference(hf: Any, text: str) -> list[int]:
    return [i for word in smollm_words(text) for i in hf_ids(hf, word, allow_special=False)]


def test_metadata(smollm: Tokenizer) -> None:
    assert smollm.vocab_size == 49152
    assert smollm.bos_token_id == 1
    assert not smollm.add_bos
    assert smollm.eos_token_ids == frozenset({0, 2})
    assert all(smollm.is_special(i) for i in range(17))
    assert not smollm.is_special(17)
    assert smollm.token_bytes(2) == b"<|im_end|>"
    assert smollm.chat_template is not None


@pytest.mark.parametrize("text", AGREEING)
@pytest.mark.parametrize("allow_special", [True, False])
def test_agrees_with_transformers(
    smollm: Tokenizer, hf_smollm: Any, text: str, allow_special: bool
) -> None:
    assert not may_differ(text)
    ids = smollm.encode(text, allow_special=allow_special)
    assert ids == hf_ids(hf_smollm, text, allow_special=allow_special)
    assert smollm.decode(ids) == text


@pytest.mark.parametrize("allow_special", [True, False])
def test_a_long_text_agrees_with_transformers(
    smollm: Tokenizer, hf_smollm: Any, allow_special: bool
) -> None:
    # Past LONG_TEXT_CHARS the text is encoded in a batch of one (which lets the GIL go).
    text = "".join(AGREEING) * (LONG_TEXT_CHARS // len("".join(AGREEING)) + 1)
    assert len(text) > LONG_TEXT_CHARS and not may_differ(text)
    ids = smollm.encode(text, allow_special=allow_special)
    assert ids == hf_ids(hf_smollm, text, allow_special=allow_special)


@pytest.mark.parametrize("text", DIFFERING)
def test_differs_from_transformers_by_the_smollm_rule(
    smollm: Tokenizer, hf_smollm: Any, text: str
) -> None:
    assert may_differ(text)
    ids = smollm.encode(text, allow_special=False)
    assert ids == smollm_reference(hf_smollm, text)
    assert ids != hf_ids(hf_smollm, text, allow_special=False)
    assert smollm.decode(ids) == text


def test_digits_are_single_tokens_and_whitespace_runs_stay_whole(
    smollm: Tokenizer, hf_smollm: Any
) -> None:
    def token(piece: str) -> int:
        return int(hf_smollm.convert_tokens_to_ids(piece))

    # "Ġ" is GPT-2's spelling of a space byte.
    assert smollm.encode("3  8", allow_special=False) == [token("3"), token("ĠĠ"), token("8")]
    assert smollm.encode(" 2024", allow_special=False) == [
        token(t) for t in ["Ġ", "2", "0", "2", "4"]
    ]


def test_no_merge_joins_whitespace_to_a_digit(smollm_gguf: GGUFFile) -> None:
    # Why a single space before an ASCII digit tokenizes alike either way (see the top).
    whitespace = {"Ġ", "Ċ", "ĉ", "č"}  # space, \n, \t, \r in GPT-2's alphabet
    for merge in smollm_gguf.metadata["tokenizer.ggml.merges"]:
        left, right = merge.split(" ")
        assert not (left[-1] in whitespace and right[0].isdigit() and right[0].isascii()), merge


def test_special_tokens(smollm: Tokenizer) -> None:
    text = "<|im_start|>user\nHi<|im_end|>"
    parsed = smollm.encode(text, allow_special=True)
    assert parsed[0] == 1 and parsed[-1] == 2
    plain = smollm.encode(text, allow_special=False)
    assert not any(smollm.is_special(i) for i in plain)
    assert smollm.decode(plain) == smollm.decode(parsed) == text
    assert smollm.decode(parsed, skip_special=True) == "user\nHi"


def spellable(smollm_gguf: GGUFFile) -> st.SearchStrategy[str]:
    # Characters whose every UTF-8 byte is in the vocabulary (see test_unspellable_bytes_...).
    vocab = set(smollm_gguf.metadata["tokenizer.ggml.tokens"])
    known = {b for b in range(256) if byte_to_char()[b] in vocab}
    return st.characters(codec="utf-8").filter(lambda c: set(c.encode()) <= known)


def test_unspellable_bytes_are_dropped_as_llama_cpp_does(smollm: Tokenizer) -> None:
    # SmolLM2's vocabulary lacks a few bytes (0x04, 0xF1, ...) and has no unknown token of its
    # own; llama.cpp drops such bytes one by one, and so do we. (transformers' conversion maps
    # them to <|endoftext|>, an end-of-text marker in the middle of the prompt.)
    ids = smollm.encode("a\x04b\U00040000c", allow_special=False)  # U+40000 is F1 80 80 80
    assert b"".join(smollm.token_bytes(i) for i in ids) == b"ab\x80\x80\x80c"
    assert not smollm.eos_token_ids & set(ids)


_PIECES = st.sampled_from([" ", "  ", "\n\n", "\t", "7", "42", " 1", "½", "😀", "<|im_end|>"])


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_random_text_follows_the_smollm_rule(
    smollm: Tokenizer, smollm_gguf: GGUFFile, hf_smollm: Any, data: st.DataObject
) -> None:
    pieces = st.one_of(st.text(spellable(smollm_gguf), max_size=10), _PIECES)
    text = data.draw(st.lists(pieces, max_size=10).map("".join))
    ids = smollm.encode(text, allow_special=False)
    assert ids == smollm_reference(hf_smollm, text)
    if not may_differ(text):
        assert ids == hf_ids(hf_smollm, text, allow_special=False)
    assert smollm.decode(ids) == text


def with_metadata(gguf: GGUFFile, **changes: Any) -> GGUFFile:
    metadata = dict(gguf.metadata)
    for key, value in changes.items():
        name = "tokenizer.ggml." + key
        if value is None:
            metadata.pop(name, None)
        else:
            metadata[name] = value
    return dataclasses.replace(gguf, metadata=metadata)


def test_gpt2_pre_tokenizer_is_transformers_exactly(smollm_gguf: GGUFFile, hf_smollm: Any) -> None:
    # With `pre = "gpt2"` our pre-tokenizer is the one transformers uses, differing cases included.
    gpt2 = gguf_tokenizer(with_metadata(smollm_gguf, pre="gpt2"))
    for text in AGREEING + DIFFERING:
        assert gpt2.encode(text, allow_special=True) == hf_ids(hf_smollm, text, allow_special=True)


def test_llama_bpe_pre_tokenizer(
    smollm_gguf: GGUFFile,
    llama3_tokenizer_json: dict[str, Any],
    llama3: Tokenizer,
) -> None:
    # The LLaMA-3 vocabulary written as GGUF metadata, as llama.cpp's converter writes it.
    model = llama3_tokenizer_json["model"]
    tokens = [""] * llama3.vocab_size
    for token, token_id in model["vocab"].items():
        tokens[token_id] = token
    types = [1] * llama3.vocab_size
    for added in llama3_tokenizer_json["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = 3
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    gguf = with_metadata(
        smollm_gguf,
        pre="llama-bpe",
        tokens=tokens,
        token_type=types,
        merges=merges,
        bos_token_id=128000,
        eos_token_id=128009,
        add_bos_token=None,
        padding_token_id=None,
        unknown_token_id=None,
    )
    tokenizer = gguf_tokenizer(gguf)
    assert tokenizer.add_bos
    assert tokenizer.eos_token_ids == llama3.eos_token_ids
    for text in AGREEING + DIFFERING + ["1234567 <|eot_id|>", "  \n\n  x"]:
        for allow_special in (True, False):
            expected = llama3.encode(text, allow_special=allow_special)
            assert tokenizer.encode(text, allow_special=allow_special) == expected


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"pre": "qwen2"}, "unsupported pre-tokenizer.*qwen2"),
        ({"model": "bert"}, "'bert' is not supported"),
        ({"model": "llama", "scores": None}, "SentencePiece vocabulary needs .*scores"),
        ({"model": None}, "carries no tokenizer"),
        ({"tokens": None}, "lacks 'tokenizer.ggml.tokens'"),
        ({"merges": ["Ġt"]}, "malformed BPE merge"),
        ({"eos_token_id": 10**6}, "eos_token_id"),
        ({"token_type": [1, 1]}, "token types"),
    ],
)
def test_bad_metadata_is_a_format_error(
    smollm_gguf: GGUFFile, changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(ModelFormatError, match=message):
        gguf_tokenizer(with_metadata(smollm_gguf, **changes))


def test_missing_pre_means_gpt2_default(smollm_gguf: GGUFFile, hf_smollm: Any) -> None:
    tokenizer = gguf_tokenizer(with_metadata(smollm_gguf, pre=None))
    assert tokenizer.encode("3  8", allow_special=False) == hf_ids(
        hf_smollm, "3  8", allow_special=False
    )
