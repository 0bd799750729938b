"""Mistral's Tekken vocabulary (NeMo's; Small 3.x, Devstral and Ministral 3 use its kind) in a
GGUF as llama.cpp's converter writes it (`tokenizer.ggml.pre = "tekken"`: byte-level BPE that
looks whole words up first) tokenizes as Mistral's own tokenizer: tiktoken over the same ranks
with the same pattern, which is what mistral-common's Tekkenizer runs. The vocabulary is the
one mistral-common ships (its wheel, sha256-pinned)."""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
from pathlib import Path
from typing import Any

import gguf
import pytest
import tiktoken
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine import registry
from engine.tokenizer import Tokenizer, load_tokenizer
from engine.tokenizer.byte_level import byte_to_char

TEKKEN = registry.WheelFile(
    requirement="mistral-common==1.13.1",
    member="mistral_common/data/tekken_240718.json",
    sha256="eccd1665d2e477697c33cb7f0daa6f6dfefc57a0a6bceb66d4be52952f827516",
    size=14_801_223,
)
NAMED = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"]
NAMED += ["[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]"]


@pytest.fixture(scope="module")
def tekken(tandem_home: Path) -> dict[str, Any]:
    wheel = registry.download(TEKKEN, tandem_home / "wheels")
    with registry.open_member(wheel, TEKKEN.member) as f:
        data = f.read()
    assert hashlib.sha256(data).hexdigest() == TEKKEN.sha256
    loaded: dict[str, Any] = json.loads(data)
    return loaded


@pytest.fixture(scope="module")
def ranks(tekken: dict[str, Any]) -> dict[bytes, int]:
    """The ranks a model of the default size uses (its vocabulary less its special tokens)."""
    config = tekken["config"]
    inner = config["default_vocab_size"] - config["default_num_special_tokens"]
    return {base64.b64decode(v["token_bytes"]): v["rank"] for v in tekken["vocab"][:inner]}


@pytest.fixture(scope="module")
def reference(tekken: dict[str, Any], ranks: dict[bytes, int]) -> tiktoken.Encoding:
    pattern = tekken["config"]["pattern"]
    return tiktoken.Encoding("tekken", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})


def merges_of(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """tiktoken keeps ranks, BPE files merges: each token's merge is the last step of merging
    its bytes by rank below its own (as transformers converts tiktoken vocabularies)."""
    found = []
    for token, rank in ranks.items():
        parts = [bytes([b]) for b in token]
        while len(parts) > 1:
            pairs = [(ranks.get(a + b), i) for i, (a, b) in enumerate(itertools.pairwise(parts))]
            best = min(((r, i) for r, i in pairs if r is not None and r < rank), default=None)
            if best is None:
                break
            i = best[1]
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        if len(token) > 1:
            assert len(parts) == 2, token
            found.append((rank, parts[0], parts[1]))
    return [(a, b) for _, a, b in sorted(found)]


@pytest.fixture(scope="module")
def tekken_gguf(
    tekken: dict[str, Any], ranks: dict[bytes, int], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    specials = tekken["config"]["default_num_special_tokens"]
    chars = byte_to_char()

    def text(token: bytes) -> str:
        return "".join(chars[b] for b in token)

    tokens = NAMED + [f"<SPECIAL_{i}>" for i in range(len(NAMED), specials)]
    tokens += [text(t) for t, _ in sorted(ranks.items(), key=lambda kv: kv[1])]
    types = [gguf.TokenType.CONTROL] * specials + [gguf.TokenType.NORMAL] * len(ranks)
    path = tmp_path_factory.mktemp("tekken") / "tekken-vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("tekken")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([f"{text(a)} {text(b)}" for a, b in merges_of(ranks)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
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
    specials = 1000  # Tekken's ids are its ranks after its special tokens
    expected = [specials + i for i in reference.encode(text, disallowed_special=())]
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
