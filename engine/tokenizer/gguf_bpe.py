"""The byte-level BPE tokenizer a GGUF file carries in its `tokenizer.ggml.*` metadata."""

from __future__ import annotations

from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models

from engine.errors import ModelFormatError
from engine.gguf_file import GGUFFile
from engine.tokenizer.byte_level import token_to_bytes
from engine.tokenizer.chat_template import ChatTemplate
from engine.tokenizer.hf_backed import HFBackedTokenizer
from engine.tokenizer.pre_tokenizers import ignores_merges, pre_tokenizer_for

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

_SPECIAL_TEXT_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def _string_list(gguf: GGUFFile, key: str) -> list[str]:
    value = gguf.require(key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ModelFormatError(f"{gguf.path.name}: {key} is not a list of strings")
    return value


def _token_id(gguf: GGUFFile, key: str, vocab_size: int) -> int | None:
    value: Any = gguf.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or not 0 <= value < vocab_size:
        raise ModelFormatError(f"{gguf.path.name}: {key}={value!r} is not a token id")
    return value


def _merges(gguf: GGUFFile) -> list[tuple[str, str]]:
    pairs = []
    for merge in _string_list(gguf, "tokenizer.ggml.merges"):
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right:
            raise ModelFormatError(f"{gguf.path.name}: malformed BPE merge {merge!r}")
        pairs.append((left, right))
    return pairs


def gguf_tokenizer(gguf: GGUFFile) -> HFBackedTokenizer:
    name = gguf.path.name
    kind = gguf.get("tokenizer.ggml.model")
    if kind is None:
        raise ModelFormatError(f"{name} carries no tokenizer (tokenizer.ggml.model is missing)")
    if kind != "gpt2":
        raise ModelFormatError(
            f"{name}: tokenizer.ggml.model={kind!r} is not supported; "
            "only byte-level BPE ('gpt2') GGUF tokenizers are"
        )
    tokens = _string_list(gguf, "tokenizer.ggml.tokens")
    types = gguf.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ModelFormatError(f"{name}: {len(types)} token types for {len(tokens)} tokens")
    # llama.cpp takes a missing `pre` as the GPT-2 default, and so do we.
    pre = str(gguf.get("tokenizer.ggml.pre", "default"))

    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=_merges(gguf), ignore_merges=ignores_merges(pre))
    )
    backend.pre_tokenizer = pre_tokenizer_for(pre)
    backend.decoder = decoders.ByteLevel()

    stop_ids = {i for i, t in enumerate(tokens) if t in END_OF_GENERATION_TEXTS}
    for key in ("eos", "eot", "eom"):
        stop = _token_id(gguf, f"tokenizer.ggml.{key}_token_id", len(tokens))
        if stop is not None:
            stop_ids.add(stop)
    special_ids = {i for i, t in enumerate(types) if t == CONTROL} | stop_ids
    user_ids = {i for i, t in enumerate(types) if t == USER_DEFINED}
    backend.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special_ids)]
    )
    backend.add_tokens(
        [AddedToken(tokens[i], special=False, normalized=False) for i in sorted(user_ids)]
    )

    pieces = []
    for i, token in enumerate(tokens):
        # Control and user-defined tokens are stored as their text, the rest in GPT-2's alphabet.
        raw = None if i in special_ids or i in user_ids else token_to_bytes(token)
        pieces.append(token.encode() if raw is None else raw)

    bos = _token_id(gguf, "tokenizer.ggml.bos_token_id", len(tokens))
    # As in llama.cpp: BPE vocabularies add no BOS unless LLaMA-3's, or the file says so.
    add_bos = bool(gguf.get("tokenizer.ggml.add_bos_token", ignores_merges(pre)))
    template = gguf.get("tokenizer.chat_template")
    ids = {field: _token_id(gguf, key, len(tokens)) for field, key in _SPECIAL_TEXT_KEYS.items()}
    text = {field: tokens[i] for field, i in ids.items() if i is not None}
    return HFBackedTokenizer(
        backend=backend,
        pieces=pieces,
        special_ids=frozenset(special_ids),
        bos_token_id=bos,
        eos_token_ids=frozenset(stop_ids),
        add_bos=add_bos and bos is not None,
        chat_template=ChatTemplate(template) if isinstance(template, str) else None,
        special_token_text=text,
    )
