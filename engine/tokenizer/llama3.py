"""The LLaMA-3 tokenizer: tiktoken BPE ranks from `tokenizer.model`, Meta's 256 special tokens."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Literal

import tiktoken

from engine.errors import ModelFormatError, ModelNotFound
from engine.tokenizer.base import Tokenizer
from engine.tokenizer.chat_template import ChatTemplate
from engine.tokenizer.pre_tokenizers import LLAMA3_PATTERN

# The order fixes the ids: they follow the base vocabulary (128000 for <|begin_of_text|>),
# exactly as in Meta's llama_models/llama3/tokenizer.py.
NAMED_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|image|>",
)
NUM_SPECIAL_TOKENS = 256
SPECIAL_TOKENS = NAMED_SPECIAL_TOKENS + tuple(
    f"<|reserved_special_token_{2 + i}|>"
    for i in range(NUM_SPECIAL_TOKENS - len(NAMED_SPECIAL_TOKENS))
)

# Meta's chat format (llama_models/llama3/chat_format.py): a header per message, the content
# as is, <|eot_id|> after each; the "tool" role is spelled "ipython".
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|start_header_id|>{{ 'ipython' if message['role'] == 'tool' else message['role'] }}"
    "<|end_header_id|>\n\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# tiktoken panics on very long inputs and slows down quadratically on long runs of one
# character class; Meta cuts the text like this before encoding, and so do we, so that ids match.
_MAX_ENCODE_CHARS = 400_000
_MAX_RUN_CHARS = 25_000


def read_ranks(path: Path) -> dict[bytes, int]:
    """The `base64-token rank` lines of a tiktoken BPE file."""
    if not path.is_file():
        raise ModelNotFound(f"no such tokenizer file: {path}")
    ranks: dict[bytes, int] = {}
    try:
        lines = path.read_text(encoding="ascii").splitlines()
    except (UnicodeDecodeError, OSError) as err:
        raise ModelFormatError(f"{path.name} is not a tiktoken BPE file: {err}") from err
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error) as err:
            raise ModelFormatError(f"{path.name}:{number}: not a 'token rank' line") from err
    if not ranks:
        raise ModelFormatError(f"{path.name} holds no BPE ranks")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ModelFormatError(f"{path.name}: the ranks are not 0..{len(ranks) - 1}")
    return ranks


def _split_runs(text: str) -> Iterator[str]:
    if len(text) <= _MAX_RUN_CHARS:
        yield text
        return
    for start in range(0, len(text), _MAX_ENCODE_CHARS):
        chunk = text[start : start + _MAX_ENCODE_CHARS]
        slice_start = 0
        run = 0
        in_space = chunk[:1].isspace()
        for i, char in enumerate(chunk):
            if char.isspace() != in_space:
                in_space = not in_space
                run = 1
                continue
            run += 1
            if run > _MAX_RUN_CHARS:
                yield chunk[slice_start:i]
                slice_start = i
                run = 1
        yield chunk[slice_start:]


class Llama3Tokenizer(Tokenizer):
    def __init__(self, path: Path) -> None:
        ranks = read_ranks(path)
        base = len(ranks)
        special = {token: base + i for i, token in enumerate(SPECIAL_TOKENS)}
        self._encoding = tiktoken.Encoding(
            name=path.name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=special
        )
        # The ranks are 0..base-1 (read_ranks checks), and the special ids follow them.
        pieces = [*sorted(ranks, key=ranks.__getitem__), *(text.encode() for text in special)]
        super().__init__(
            pieces=pieces,
            special_ids=frozenset(special.values()),
            bos_token_id=special["<|begin_of_text|>"],
            eos_token_ids=frozenset(
                special[t] for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")
            ),
            add_bos=True,
            chat_template=ChatTemplate(CHAT_TEMPLATE),
            special_token_text={"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"},
        )

    @property
    def encoding(self) -> tiktoken.Encoding:
        return self._encoding

    def _encode(self, text: str, *, allow_special: bool) -> list[int]:
        allowed: Literal["all"] | AbstractSet[str] = "all" if allow_special else frozenset()
        ids: list[int] = []
        for part in _split_runs(text):
            ids.extend(self._encoding.encode(part, allowed_special=allowed, disallowed_special=()))
        return ids
