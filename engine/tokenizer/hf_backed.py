"""A tokenizer whose encoding runs in Hugging Face `tokenizers` (GGUF and tokenizer.json)."""

from __future__ import annotations

from dataclasses import dataclass

import tokenizers

from engine.tokenizer.base import Tokenizer

LONG_TEXT_CHARS = 4096


@dataclass(kw_only=True, eq=False, repr=False)
class HFBackedTokenizer(Tokenizer):
    backend: tokenizers.Tokenizer

    def __post_init__(self) -> None:
        # `encode_special_tokens` is a mode of the whole tokenizer object, so each mode gets its
        # own object rather than flipping a shared one between calls from different threads.
        self._as_text = tokenizers.Tokenizer.from_str(self.backend.to_str())
        self._as_text.encode_special_tokens = True

    def _encode(self, text: str, *, allow_special: bool) -> list[int]:
        backend = self.backend if allow_special else self._as_text
        # BOS is the caller's decision (see `encode_prompt`), so no post-processor runs here.
        if len(text) > LONG_TEXT_CHARS:
            # encode() holds the GIL for the whole text; encode_batch() lets it go, so a
            # caller's other threads, an event loop above all, run meanwhile.
            return backend.encode_batch([text], add_special_tokens=False)[0].ids
        return backend.encode(text, add_special_tokens=False).ids
