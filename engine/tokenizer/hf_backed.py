"""A tokenizer whose encoding runs in Hugging Face `tokenizers` (GGUF and tokenizer.json)."""

from __future__ import annotations

from collections.abc import Sequence

import tokenizers

from engine.tokenizer.base import Tokenizer
from engine.tokenizer.chat_template import ChatTemplate

LONG_TEXT_CHARS = 4096


class HFBackedTokenizer(Tokenizer):
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        pieces: Sequence[bytes],
        special_ids: frozenset[int],
        bos_token_id: int | None,
        eos_token_ids: frozenset[int],
        add_bos: bool,
        chat_template: ChatTemplate | None,
        special_token_text: dict[str, str],
        strips_leading_space: bool = False,
    ) -> None:
        super().__init__(
            pieces=pieces,
            special_ids=special_ids,
            bos_token_id=bos_token_id,
            eos_token_ids=eos_token_ids,
            add_bos=add_bos,
            chat_template=chat_template,
            special_token_text=special_token_text,
            strips_leading_space=strips_leading_space,
        )
        # `encode_special_tokens` is a mode of the whole tokenizer object, so each mode gets its
        # own object rather than flipping a shared one between calls from different threads.
        self._with_special = backend
        self._as_text = tokenizers.Tokenizer.from_str(backend.to_str())
        self._as_text.encode_special_tokens = True

    def _encode(self, text: str, *, allow_special: bool) -> list[int]:
        backend = self._with_special if allow_special else self._as_text
        # BOS is the caller's decision (see `encode_prompt`), so no post-processor runs here.
        if len(text) > LONG_TEXT_CHARS:
            # encode() holds the GIL for the whole text; encode_batch() lets it go, so a
            # caller's other threads, an event loop above all, run meanwhile.
            return backend.encode_batch([text], add_special_tokens=False)[0].ids
        return backend.encode(text, add_special_tokens=False).ids
