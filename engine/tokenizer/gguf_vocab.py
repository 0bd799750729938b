"""What every GGUF vocabulary holds, whatever its tokenizer: token texts and types, the ids of
BOS, EOS and their kin, and the tokens that end generation."""

from __future__ import annotations

from typing import Any

import tokenizers
from tokenizers import AddedToken

from engine.errors import ModelFormatError
from engine.gguf_file import GGUFFile
from engine.tokenizer.chat_template import ChatTemplate

# llama.cpp's token types (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp ends generation on these texts whatever the file's ids say (llama-vocab.cpp);
# that is how SmolLM2 stops on <|endoftext|> as well as on its eos <|im_end|>.
END_OF_GENERATION_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "<|end_of_text|>",
        "<end_of_utterance>",
    }
)

SPECIAL_TEXT_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def string_list(gguf: GGUFFile, key: str) -> list[str]:
    value = gguf.require(key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ModelFormatError(f"{gguf.path.name}: {key} is not a list of strings")
    return value


def token_id(gguf: GGUFFile, key: str, vocab_size: int) -> int | None:
    value: Any = gguf.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or not 0 <= value < vocab_size:
        raise ModelFormatError(f"{gguf.path.name}: {key}={value!r} is not a token id")
    return value


def token_types(gguf: GGUFFile, vocab_size: int) -> list[int]:
    types = gguf.get("tokenizer.ggml.token_type") or [NORMAL] * vocab_size
    if len(types) != vocab_size:
        raise ModelFormatError(
            f"{gguf.path.name}: {len(types)} token types for {vocab_size} tokens"
        )
    return types


def stop_ids(gguf: GGUFFile, tokens: list[str]) -> set[int]:
    """The tokens that end generation: EOS, EOT and EOM where the file names them, and those
    whose text llama.cpp ends on."""
    stops = {i for i, t in enumerate(tokens) if t in END_OF_GENERATION_TEXTS}
    for key in ("eos", "eot", "eom"):
        stop = token_id(gguf, f"tokenizer.ggml.{key}_token_id", len(tokens))
        if stop is not None:
            stops.add(stop)
    return stops


def add_control_tokens(
    backend: tokenizers.Tokenizer, gguf: GGUFFile, tokens: list[str], types: list[int]
) -> tuple[set[int], set[int], set[int]]:
    """Control tokens and those that end generation become special tokens of `backend`, and
    user-defined ones added text, each matched whole; (special, user-defined, stop) ids."""
    stops = stop_ids(gguf, tokens)
    special = {i for i, t in enumerate(types) if t == CONTROL} | stops
    user = {i for i, t in enumerate(types) if t == USER_DEFINED}
    backend.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special)]
    )
    backend.add_tokens(
        [AddedToken(tokens[i], special=False, normalized=False) for i in sorted(user)]
    )
    return special, user, stops


def special_token_text(gguf: GGUFFile, tokens: list[str]) -> dict[str, str]:
    """bos_token, eos_token, ... as the chat template sees them."""
    ids = {field: token_id(gguf, key, len(tokens)) for field, key in SPECIAL_TEXT_KEYS.items()}
    return {field: tokens[i] for field, i in ids.items() if i is not None}


def chat_template(gguf: GGUFFile) -> ChatTemplate | None:
    template = gguf.get("tokenizer.chat_template")
    return ChatTemplate(template) if isinstance(template, str) else None
