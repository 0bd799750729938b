"""Mistral's Tekken vocabulary (NeMo's, as mistral-common ships it) and the GGUF tokenizer
metadata llama.cpp's converter writes for it, for tests."""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import tiktoken

from engine import registry
from engine.errors import FetchError
from engine.tokenizer.byte_level import byte_to_char

TEKKEN = registry.WheelFile(
    requirement="mistral-common==1.13.1",
    member="mistral_common/data/tekken_240718.json",
    sha256="eccd1665d2e477697c33cb7f0daa6f6dfefc57a0a6bceb66d4be52952f827516",
    size=14_801_223,
)
# The first of Tekken's control tokens, as mistral-common names them; the rest are placeholders.
NAMED = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"]
NAMED += ["[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]"]


@dataclass(frozen=True)
class Tekken:
    pattern: str
    specials: int  # control tokens before the ranked ones: a rank's id is specials + rank
    ranks: dict[bytes, int]

    def reference(self) -> tiktoken.Encoding:
        """Mistral's own tokenizer of these ranks: tiktoken with Tekken's pattern."""
        return tiktoken.Encoding(
            "tekken", pat_str=self.pattern, mergeable_ranks=self.ranks, special_tokens={}
        )

    def add_to(self, writer: gguf.GGUFWriter) -> int:
        """Its tokenizer metadata, as llama.cpp's converter writes it; the vocabulary's size."""
        chars = byte_to_char()

        def text(token: bytes) -> str:
            return "".join(chars[b] for b in token)

        tokens = NAMED + [f"<SPECIAL_{i}>" for i in range(len(NAMED), self.specials)]
        tokens += [text(t) for t, _ in sorted(self.ranks.items(), key=lambda kv: kv[1])]
        types = [gguf.TokenType.CONTROL] * self.specials
        types += [gguf.TokenType.NORMAL] * len(self.ranks)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("tekken")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges([f"{text(a)} {text(b)}" for a, b in merges_of(self.ranks)])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        return len(tokens)


def load_tekken(home: Path) -> Tekken:
    """The ranks a model of the default size uses (the vocabulary less its special tokens)."""
    wheel = registry.download(TEKKEN, home / "wheels")
    with registry.open_member(wheel, TEKKEN.member) as f:
        data = f.read()
    if hashlib.sha256(data).hexdigest() != TEKKEN.sha256:
        raise FetchError(f"{TEKKEN.member}: sha256 is not the pinned one")
    loaded: dict[str, Any] = json.loads(data)
    config = loaded["config"]
    specials = config["default_num_special_tokens"]
    inner = config["default_vocab_size"] - specials
    ranks = {base64.b64decode(v["token_bytes"]): v["rank"] for v in loaded["vocab"][:inner]}
    return Tekken(config["pattern"], specials, ranks)


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
