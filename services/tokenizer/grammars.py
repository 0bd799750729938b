"""Output formats compiled at the edge: a bad schema or regex is refused before it is queued,
naming the field, and each distinct format is compiled once (off the event loop: a large
schema takes milliseconds)."""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict

import llguidance

from engine.guided import OutputFormat, compile_format, grammar_tokenizer
from engine.tokenizer import Tokenizer

_KEPT = 256  # compiled formats kept, most recently used first


class Grammars:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._vocabulary: llguidance.LLTokenizer | None = None  # built on the first format
        self._lock = threading.Lock()
        self._compiled: OrderedDict[OutputFormat, str] = OrderedDict()

    async def compile(self, fmt: OutputFormat) -> str:
        """The grammar the worker follows for `fmt`; InvalidRequest naming fmt.field."""
        grammar = self._compiled.get(fmt)
        if grammar is None:
            grammar = await asyncio.to_thread(self._compile, fmt)
        with self._lock:
            self._compiled[fmt] = grammar
            self._compiled.move_to_end(fmt)
            if len(self._compiled) > _KEPT:
                self._compiled.popitem(last=False)
        return grammar

    def _compile(self, fmt: OutputFormat) -> str:
        with self._lock:
            if self._vocabulary is None:
                self._vocabulary = grammar_tokenizer(self._tokenizer, self._tokenizer.vocab_size)
            vocabulary = self._vocabulary
        return compile_format(fmt, vocabulary)
