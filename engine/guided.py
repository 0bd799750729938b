"""Guided decoding: output held to a JSON schema, a regex, a list of choices or a grammar.

llguidance compiles the form into a grammar once, at the edge (`compile_format`, which also
checks it against the model's vocabulary). The worker follows each constrained sequence with a
matcher that consumes the tokens sampled so far and says which tokens may come next, as a
bitmask the sampler applies before its pick (`Guides`). Once the form is complete, only the
end-of-sequence tokens stay allowed, so the sequence ends there.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark
from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par
from llguidance.tiktoken import lltokenizer_from_encoding

from engine.errors import InvalidRequest
from engine.sampling_params import MAX_GRAMMAR_BYTES
from engine.tokenizer import Tokenizer
from engine.tokenizer.llama3 import Llama3Tokenizer

log = logging.getLogger(__name__)

MAX_CHOICES = 256
# JSON as most models write it when they are not held to a layout: ", " and ": " between items,
# no newlines. Free whitespace lets a small model pad a value with spaces until max_tokens.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# What the regex syntax (Rust's) gives a meaning to: escaped, a choice is matched as it is.
_REGEX_SPECIAL = frozenset("\\.+*?()|[]{}^$")
_SOURCE = re.compile(r"^\d+ \|")  # "1 | start: /(/": the generated grammar's line
_POSITION = re.compile(r"^at \d+\(\d+\): ")
_PARALLEL_ROWS = 8  # rows from which masks are computed on llguidance's threads
_COMPILED_KEPT = 64  # compiled grammars a worker keeps, most recently used first
_TOKENIZED_KEPT = 4096  # texts whose tokens a vocabulary keeps

FormatKind = Literal["json_object", "json_schema", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class OutputFormat:
    """What a request holds its output to. `value`: the schema's JSON text, the regex, the
    choices, or the grammar (Lark as llguidance reads it, or GBNF); `field`: the request field
    it came from, named in errors."""

    kind: FormatKind
    value: str | tuple[str, ...] = ""
    field: str = "output_format"


def grammar_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """The vocabulary as llguidance sees it: each id's bytes (a special token's marked, so text
    never spells it), and the ids that end a sequence."""
    n_vocab = max(vocab_size, tokenizer.vocab_size)
    eos = sorted(tokenizer.eos_token_ids)
    if native(tokenizer):
        assert isinstance(tokenizer, Llama3Tokenizer)
        return lltokenizer_from_encoding(tokenizer.encoding, n_vocab=n_vocab, eos_token=eos)
    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(_Vocabulary(tokenizer)), n_vocab=n_vocab, eos_token=eos
    )


def native(tokenizer: Tokenizer) -> bool:
    """Whether llguidance encodes `tokenizer`'s text itself, never calling back into Python: a
    mask tokenizes the bytes its grammar forces. tiktoken's ranks it reads (as ordinary text:
    special text stays text); `tokenizers` it would read special text as the special token with
    (and so end a sequence whose grammar forces "<|im_end|>"), so that encoding runs here."""
    return isinstance(tokenizer, Llama3Tokenizer)


class _Vocabulary:
    """The attributes llguidance.TokenizerWrapper reads from a tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        special = tokenizer.special_ids
        self.eos_token_id = min(tokenizer.eos_token_ids)
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [
            b"\xff" + p if i in special else bytes(p) for i, p in enumerate(tokenizer.pieces)
        ]
        self.special_token_ids = sorted(special)
        self._tokenizer = tokenizer
        # A mask tokenizes the bytes its grammar forces: the same few texts (a schema's keys and
        # separators) at every step of every row.
        self._encode = functools.lru_cache(maxsize=_TOKENIZED_KEPT)(self._encode_text)

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._encode(text)

    def _encode_text(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, allow_special=False)


def compile_format(fmt: OutputFormat, tokenizer: llguidance.LLTokenizer) -> str:
    """The grammar of `fmt`, checked against the vocabulary; InvalidRequest naming fmt.field
    for a form that is malformed, unsupported or too large."""
    grammar = _grammar(fmt)
    size = len(grammar.encode())
    if size > MAX_GRAMMAR_BYTES:
        raise InvalidRequest(
            fmt.field, f"compiles to a grammar of {size:,} bytes; at most {MAX_GRAMMAR_BYTES:,}"
        )
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise InvalidRequest(fmt.field, _message(error))
    return grammar


def _grammar(fmt: OutputFormat) -> str:
    if fmt.kind == "json_object":
        return _json_grammar({"type": "object"})
    if fmt.kind == "json_schema":
        assert isinstance(fmt.value, str)
        try:
            schema = json.loads(fmt.value)
        except json.JSONDecodeError as err:
            raise InvalidRequest(fmt.field, f"is not JSON: {err}") from None
        if not isinstance(schema, dict | bool):
            raise InvalidRequest(
                fmt.field, f"a JSON schema is an object, not {type(schema).__name__}"
            )
        return _json_grammar(schema)
    if fmt.kind == "regex":
        assert isinstance(fmt.value, str)
        if not fmt.value:
            raise InvalidRequest(fmt.field, "is empty")
        return llguidance.LLMatcher.grammar_from_regex(fmt.value)
    if fmt.kind == "grammar":
        assert isinstance(fmt.value, str)
        if not fmt.value.strip():
            raise InvalidRequest(fmt.field, "is empty")
        try:
            lark = any_to_lark(fmt.value)  # llama.cpp's and xgrammar's GBNF becomes Lark
        except GbnfToLarkError as err:
            raise InvalidRequest(fmt.field, f"is neither Lark nor GBNF: {err}") from None
        return llguidance.LLMatcher.grammar_from_lark(lark)
    choices = fmt.value
    if not choices or len(choices) > MAX_CHOICES:
        raise InvalidRequest(fmt.field, f"give 1 to {MAX_CHOICES} choices, not {len(choices)}")
    if any(not c for c in choices):
        raise InvalidRequest(fmt.field, "a choice is empty")
    pattern = "|".join(
        "".join("\\" + ch if ch in _REGEX_SPECIAL else ch for ch in c) for c in choices
    )
    return llguidance.LLMatcher.grammar_from_regex(f"({pattern})")


def _json_grammar(schema: dict[str, Any] | bool) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_LAYOUT)  # type: ignore[arg-type]


def _message(error: str) -> str:
    """llguidance's error on one line: without its pointers into the grammar it generated (a
    position, a source line, a caret), which the user never wrote."""
    lines = [line.strip() for line in error.strip().splitlines()]
    kept = [line for line in lines if re.search("[A-Za-z]", line) and not _SOURCE.match(line)]
    return _POSITION.sub("", " ".join(kept)) or error


@dataclass
class _Follow:
    matcher: llguidance.LLMatcher
    consumed: int  # output tokens the matcher has taken


class Guides:
    """The matchers of a worker's constrained sequences, each fed the tokens sampled so far.

    `vocabulary` gives the model's tokenizer, read once: by `warm` (the worker, before it
    serves), or else on the first grammar."""

    def __init__(
        self, vocabulary: Callable[[], Tokenizer], vocab_size: int, threads: int | None = None
    ) -> None:
        self._vocabulary = vocabulary
        self.vocab_size = vocab_size
        # llguidance's threads for a large batch's masks (its own default: 80% of the cores, up
        # to 32); two at least: on 2 cores, two took 256 masks in 40% of one's time.
        cores = os.cpu_count() or 1
        self.threads = threads if threads is not None else min(32, max(2, cores * 4 // 5))
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._parallel = False  # masks on llguidance's threads (known with the vocabulary)
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._follows: dict[Any, _Follow] = {}

    def check(self, grammar: str) -> None:
        """Compile `grammar` now (kept for the sequences that use it); InvalidRequest if it does
        not compile, so a bad one fails its own sequence before any step."""
        self._template(grammar)

    def masks(
        self, seq_ids: Sequence[Any], grammars: Sequence[str], outputs: Sequence[Sequence[int]]
    ) -> np.ndarray:
        """(R, words) int32 bitmasks of the tokens row r may take next, after the output tokens
        `outputs[r]` (everything the sequence sampled before this step)."""
        # As wide as llguidance writes: the vocabulary it was given (at least the model's).
        masks = np.zeros((len(seq_ids), (self.tokenizer.vocab_size + 31) // 32), dtype=np.int32)
        matchers = [
            self._follow(seq_id, grammar, output).matcher
            for seq_id, grammar, output in zip(seq_ids, grammars, outputs, strict=True)
        ]
        live = [(m, r) for r, m in enumerate(matchers) if not m.is_error()]
        if self._parallel and len(live) >= _PARALLEL_ROWS:
            # On llguidance's threads: a host with cores to spare computes a large batch's
            # masks in a fraction of the time (it does not wait for the device meanwhile).
            fill_next_token_bitmask_par(self._executor, live, masks)
        else:
            for matcher, r in live:
                fill_next_token_bitmask(matcher, masks, r)
        for r, matcher in enumerate(matchers):
            if matcher.is_error() or not masks[r].any():
                # Sampling cannot have left the grammar; should a matcher fail anyway, the
                # sequence ends rather than sampling from nothing.
                log.warning("sequence %s left its grammar: %s", seq_ids[r], matcher.get_error())
                masks[r] = 0
                bits = masks.view(np.uint32)
                for t in self.tokenizer.eos_tokens:
                    bits[r, t >> 5] |= np.uint32(1 << (t & 31))
        return masks

    @functools.cached_property
    def _executor(self) -> llguidance.LLExecutor:
        return llguidance.LLExecutor(self.threads)

    def warm(self) -> None:
        """Read the vocabulary now rather than at the first grammar."""
        _ = self.tokenizer

    def release(self, seq_id: Any) -> None:
        self._follows.pop(seq_id, None)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                vocabulary = self._vocabulary()
                self._tokenizer = grammar_tokenizer(vocabulary, self.vocab_size)
                # Threads that call back into Python for each mask wait on each other for the
                # GIL: 256 rows took twice the loop's time on 2 threads (bench/guided_masks.py).
                self._parallel = self.threads > 1 and native(vocabulary)
            return self._tokenizer

    def _follow(self, seq_id: Any, grammar: str, output: Sequence[int]) -> _Follow:
        follow = self._follows.get(seq_id)
        if follow is None or follow.consumed > len(output):
            # New, or resumed shorter than it was (a recompute): follow it again from the start.
            follow = self._follows[seq_id] = _Follow(self._template(grammar).deep_copy(), 0)
        if follow.consumed < len(output):
            follow.matcher.consume_tokens(list(output[follow.consumed :]))
            follow.consumed = len(output)
        return follow

    def _template(self, grammar: str) -> llguidance.LLMatcher:
        template = self._compiled.get(grammar)
        if template is None:
            template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            if template.is_error():
                raise InvalidRequest("output_format", _message(template.get_error()))
            self._compiled[grammar] = template
            if len(self._compiled) > _COMPILED_KEPT:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        return template
