"""Stop strings and stop token ids: the text ends before the first stop to begin, and the last
message names what ended it (vLLM's stop_reason, Anthropic's stop_sequence)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.stop_strings import StopStringMatcher
from engine.tokenizer import Tokenizer, load_tokenizer
from services.client_types import generate_request
from services.tokenizer.request import parse_generate
from services.tokenizer.stream import TextStream
from tandem.internal.v1 import hotpath_pb2 as hp

TEXT = st.text(alphabet="abc", max_size=30)


@given(text=TEXT, stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=3), max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=6))  # fmt: skip
def test_the_text_ends_before_the_first_stop_to_begin(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    matcher = StopStringMatcher(stops)
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    shown = "".join(matcher.feed(text[a:b]) for a, b in itertools.pairwise(bounds))
    shown += matcher.flush()
    found = [(text.find(s), s) for s in stops if s in text]
    if not found:
        assert shown == text and matcher.matched is None and not matcher.stopped
        return
    at = min(i for i, _ in found)
    assert shown == text[:at] and matcher.stopped
    # The stop named begins there (of two beginning there, one that is there whole).
    assert matcher.matched is not None and text.startswith(matcher.matched, at)


def test_the_earliest_stop_is_named_not_the_first_listed() -> None:
    matcher = StopStringMatcher(["9,", "7,"])
    assert matcher.feed("6, 7, 8, 9,") == "6, " and matcher.matched == "7,"


@pytest.fixture(scope="module")
def tokenizer(default_gguf: Path) -> Tokenizer:
    return load_tokenizer(default_gguf)


def ended(tokenizer: Tokenizer, ids: list[int], **options: object) -> tuple[str, str | int | None]:
    """The text of a sequence of these ids ended by the model (finish "stop"), and what the
    last message names as its stop."""
    spec = parse_generate(generate_request("x", **options), "", tokenizer.vocab_size, 8192)  # type: ignore[arg-type]
    stream = TextStream(tokenizer, spec, spec.stop_token_ids | tokenizer.eos_token_ids)
    reply = stream.on_events(hp.RequestEvents(request_id="r", token_ids=ids, finish_reason="stop"))
    which = reply.WhichOneof("stopped_by")
    return reply.text, None if which is None else getattr(reply, which)


def test_the_last_message_names_the_requests_own_stop(tokenizer: Tokenizer) -> None:
    words = tokenizer.encode("one two three", allow_special=False)
    (eos, *_) = sorted(tokenizer.eos_token_ids)
    assert ended(tokenizer, [*words, eos]) == ("one two three", None)  # the model's own end
    assert ended(tokenizer, [*words, eos], stop=["two", "one t"]) == ("", "one t")
    assert ended(tokenizer, [*words, eos], stop=[" three"]) == ("one two", " three")
    kept = ended(tokenizer, [*words, eos], stop=["two t"], include_stop_str_in_output=True)
    assert kept == ("one two t", "two t")  # the text to the stop's end (vLLM's option)
    comma = tokenizer.encode(",", allow_special=False)
    assert ended(tokenizer, [*words, *comma], stop_token_ids=comma) == ("one two three", comma[0])
