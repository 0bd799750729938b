"""A reasoning model's reply split into reasoning_content and content (DeepSeek-R1's <think>),
however its text is cut into deltas, and how the HTTP answer carries both."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from engine.tokenizer import Tokenizer, load_tokenizer
from services.tokenizer.http.convert import Plan, chat_plan
from services.tokenizer.http.output import Output
from services.tokenizer.http.reasoning import ReasoningSplit, reasons
from services.tokenizer.http.schemas import ChatCompletionRequest
from tandem.v1 import generation_pb2 as pb
from tests.tokenizer.streamed import streamed

REPLIES = [
    # (the reply's text, whether the prompt opened <think>, reasoning, content)
    ("<think>\nAdd them.\n</think>\n\nIt is 4.", False, "\nAdd them.\n", "It is 4."),
    ("Add them.</think>It is 4.", True, "Add them.", "It is 4."),
    ("It is 4.", False, "", "It is 4."),
    ("Still thinking <", True, "Still thinking <", ""),  # cut short inside
    ("<thin", False, "", "<thin"),  # ended before the tag was whole: text
    ("  <think>x</think>", False, "x", ""),
    ("a </thinker> b", True, "a </thinker> b", ""),
]


@given(st.sampled_from(REPLIES), st.lists(st.integers(0, 40), max_size=6))
@example(REPLIES[0], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
@example(REPLIES[1], [9, 10, 11, 12, 13, 14, 15])
def test_a_reply_splits_the_same_however_it_streams(
    reply: tuple[str, bool, str, str], cuts: list[int]
) -> None:
    text, opened, reasoning, content = reply
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    split = ReasoningSplit(opened)
    got = [split.feed(text[a:b]) for a, b in itertools.pairwise(bounds)]
    got.append(split.flush())
    assert "".join(r for r, _ in got) == reasoning
    assert "".join(c for _, c in got) == content


def test_the_format_is_read_off_the_template() -> None:
    assert reasons("auto", "{{ '<|Assistant|><think>\\n' }}") and not reasons("auto", "{{ x }}")
    assert reasons("deepseek", "") and not reasons("none", "<think>")
    with pytest.raises(ValueError, match="unknown reasoning format 'r1'"):
        reasons("r1", "")


@pytest.fixture(scope="module")
def tokenizer(default_gguf: Path) -> Tokenizer:
    return load_tokenizer(default_gguf)


def planned(**body: Any) -> Plan:
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], **body}
    )
    return chat_plan(request, "r", "m", reasons=True)


def test_the_answer_carries_reasoning_apart(tokenizer: Tokenizer) -> None:
    """Whole: message.reasoning_content beside its content; streamed: delta.reasoning_content,
    then delta.content. A prompt that ends with <think> has the reply reason first."""
    opened = pb.GenerateResponse(
        prompt_token_ids=tokenizer.encode("Q: x\n<think>\n", allow_special=False)
    )
    whole = Output(tokenizer, "id", "m", planned())
    whole.on_prompts([opened])
    whole.add(0, pb.GenerateResponse(text="Add them.</think>\n\nIt is 4.", finish_reason="stop"))
    message = whole.whole()["choices"][0]["message"]
    assert message["reasoning_content"] == "Add them." and message["content"] == "It is 4."
    chunks = streamed(
        planned(stream=True), tokenizer, "<think>Add", " them.</th", "ink>It is", " 4."
    )
    deltas = [c["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Add them."
    assert "".join(d.get("content") or "" for d in deltas) == "It is 4."
    # Held to a form, a reply has no place for reasoning: not split.
    assert not planned(response_format={"type": "json_object"}).reasoning
