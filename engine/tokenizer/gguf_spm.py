"""The SentencePiece BPE tokenizer a GGUF file carries (`tokenizer.ggml.model` "llama": LLaMA-2,
Mistral, TinyLlama, CodeLlama), run in Hugging Face `tokenizers` as transformers runs it.

SentencePiece BPE keeps no merge list: it merges the pair whose merged piece scores highest.
The same merges, ranked by that score, make a `tokenizers` BPE that tokenizes as SentencePiece
does (transformers builds its fast LLaMA tokenizer, and its reading of such a GGUF, this way).
Spaces are U+2581 ("▁"), one is put in front of the text (`add_space_prefix`, on unless the
file says otherwise), and characters outside the vocabulary fall back to <0xNN> byte tokens."""

from __future__ import annotations

import tokenizers
from tokenizers import decoders, models, normalizers

from engine.errors import ModelFormatError
from engine.gguf_file import GGUFFile
from engine.tokenizer.gguf_vocab import (
    BYTE,
    add_control_tokens,
    chat_template,
    special_token_text,
    string_list,
    token_id,
    token_types,
)
from engine.tokenizer.hf_backed import HFBackedTokenizer

SPACE = "\u2581"


def merges_by_score(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary, ranked by the merged piece's
    score (highest first; ties by the halves' ids), as transformers derives them."""
    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}  # the first id of a text
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, score in zip(tokens, scores, strict=True):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _piece(token: str, kind: int) -> bytes:
    """The bytes a token stands for: a byte token's byte, else its text with ▁ as a space."""
    if kind == BYTE and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        return bytes([int(token[3:5], 16)])
    return token.replace(SPACE, " ").encode()


def gguf_spm_tokenizer(gguf: GGUFFile) -> HFBackedTokenizer:
    name = gguf.path.name
    tokens = string_list(gguf, "tokenizer.ggml.tokens")
    types = token_types(gguf, len(tokens))
    scores = gguf.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != len(tokens):
        raise ModelFormatError(
            f"{name}: a SentencePiece vocabulary needs tokenizer.ggml.scores, one per token"
        )
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    unk = token_id(gguf, "tokenizer.ggml.unknown_token_id", len(tokens))
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges_by_score(tokens, [float(s) for s in scores]),
            unk_token=None if unk is None else tokens[unk],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = bool(gguf.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend(SPACE)] if prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    strip = [decoders.Strip(" ", 1, 0)] if prefix else []
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    special_ids, user_ids, stops = add_control_tokens(backend, gguf, tokens, types)
    pieces = [  # control and user-defined tokens are their text
        token.encode() if i in special_ids | user_ids else _piece(token, types[i])
        for i, token in enumerate(tokens)
    ]
    bos = token_id(gguf, "tokenizer.ggml.bos_token_id", len(tokens))
    return HFBackedTokenizer(
        backend=backend,
        pieces=pieces,
        special_ids=frozenset(special_ids),
        bos_token_id=bos,
        eos_token_ids=frozenset(stops),
        # SentencePiece vocabularies begin a prompt with BOS unless the file says otherwise.
        add_bos=bool(gguf.get("tokenizer.ggml.add_bos_token", True)) and bos is not None,
        chat_template=chat_template(gguf),
        special_token_text=special_token_text(gguf, tokens),
        strips_leading_space=prefix,
    )
