"""The tokenizer a GGUF file carries in its `tokenizer.ggml.*` metadata; byte-level BPE here."""

from __future__ import annotations

import tokenizers
from tokenizers import decoders, models

from engine.errors import ModelFormatError
from engine.gguf_file import GGUFFile
from engine.tokenizer.byte_level import token_to_bytes
from engine.tokenizer.gguf_spm import gguf_spm_tokenizer
from engine.tokenizer.gguf_vocab import (
    add_control_tokens,
    chat_template,
    special_token_text,
    string_list,
    token_id,
    token_types,
)
from engine.tokenizer.hf_backed import HFBackedTokenizer
from engine.tokenizer.pre_tokenizers import ignores_merges, pre_tokenizer_for


def _merges(gguf: GGUFFile) -> list[tuple[str, str]]:
    pairs = []
    for merge in string_list(gguf, "tokenizer.ggml.merges"):
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right:
            raise ModelFormatError(f"{gguf.path.name}: malformed BPE merge {merge!r}")
        pairs.append((left, right))
    return pairs


def gguf_tokenizer(gguf: GGUFFile) -> HFBackedTokenizer:
    """The tokenizer of a GGUF file: byte-level BPE ("gpt2") or SentencePiece BPE ("llama")."""
    name = gguf.path.name
    kind = gguf.get("tokenizer.ggml.model")
    if kind is None:
        raise ModelFormatError(f"{name} carries no tokenizer (tokenizer.ggml.model is missing)")
    if kind == "llama":
        return gguf_spm_tokenizer(gguf)
    if kind != "gpt2":
        raise ModelFormatError(
            f"{name}: tokenizer.ggml.model={kind!r} is not supported; byte-level BPE ('gpt2') "
            "and SentencePiece BPE ('llama') GGUF tokenizers are"
        )
    tokens = string_list(gguf, "tokenizer.ggml.tokens")
    types = token_types(gguf, len(tokens))
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

    special_ids, user_ids, stops = add_control_tokens(backend, gguf, tokens, types)
    pieces = []
    for i, token in enumerate(tokens):
        # Control and user-defined tokens are stored as their text, the rest in GPT-2's alphabet.
        raw = None if i in special_ids or i in user_ids else token_to_bytes(token)
        pieces.append(token.encode() if raw is None else raw)

    bos = token_id(gguf, "tokenizer.ggml.bos_token_id", len(tokens))
    # As in llama.cpp: BPE vocabularies add no BOS unless LLaMA-3's, or the file says so.
    add_bos = bool(gguf.get("tokenizer.ggml.add_bos_token", ignores_merges(pre)))
    return HFBackedTokenizer(
        backend=backend,
        pieces=pieces,
        special_ids=frozenset(special_ids),
        bos_token_id=bos,
        eos_token_ids=frozenset(stops),
        add_bos=add_bos and bos is not None,
        chat_template=chat_template(gguf),
        special_token_text=special_token_text(gguf, tokens),
    )
