"""Turning generated token ids into text as they arrive, one delta per token."""

from __future__ import annotations

import codecs

from engine.tokenizer.base import Tokenizer


class Detokenizer:
    """Fed one token id at a time, returns the text that id completes.

    Byte-level tokens can end inside a UTF-8 character (an emoji is often two or three
    tokens), so the bytes of an unfinished character are held back until the token that
    finishes it arrives; only bytes that can never form a character become U+FFFD. Work per
    token is proportional to that token's bytes, never to the length of the text so far.
    The concatenated deltas equal `tokenizer.decode(ids, skip_special=skip_special)`.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._at_start = tokenizer.strips_leading_space

    def feed(self, token_id: int) -> str:
        data = self._tokenizer.token_bytes(token_id)
        if self._skip_special and self._tokenizer.is_special(token_id):
            return ""
        if self._at_start and data:
            # The first emitted token loses its word-start space, as in a full decode.
            self._at_start = False
            if data.startswith(b" "):
                data = data[1:]
        return self._utf8.decode(data)

    def flush(self) -> str:
        """The end of the stream: held-back bytes that never became a character, as U+FFFD."""
        return self._utf8.decode(b"", final=True)
