"""The Responses API's truncation "auto": the fewest oldest turns dropped that make the prompt
fit, system messages kept, the conversation begun at a user's turn; refused by name where even
the last turn does not fit. Counted here by characters (the route counts through the template)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from engine.errors import ContextLengthExceeded, InvalidRequest
from services.tokenizer.http.responses import ChatForm, ResponsesRequest, chat_form
from services.tokenizer.http.truncation import truncated

CALL = {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"}


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def form_of(items: list[dict[str, Any]], instructions: str | None = "Be brief.") -> ChatForm:
    return chat_form(ResponsesRequest(input=items, instructions=instructions, truncation="auto"))


def cut(form: ChatForm, context: int) -> tuple[list[tuple[str, Any]], list[int | None], int]:
    counts = []

    async def count(f: ChatForm) -> int:
        counts.append(f)
        return sum(len(m.content or "") for m in f.chat.messages)

    kept = asyncio.run(truncated(form, count, context))
    return [(m.role, m.content) for m in kept.chat.messages], kept.where, len(counts)


def test_a_conversation_that_fits_is_left_whole_after_one_count() -> None:
    form = form_of([user("aaaa"), assistant("bbbb"), user("cc")])
    messages, where, counts = cut(form, context=100)
    assert [c for _, c in messages] == ["Be brief.", "aaaa", "bbbb", "cc"]
    assert where == [None, 0, 1, 2] and counts == 1


def test_the_fewest_oldest_turns_are_dropped_and_the_system_kept() -> None:
    turns = [user("u" * 10), assistant("a" * 10), user("v" * 10), assistant("b" * 10)]
    form = form_of([*turns, {"role": "developer", "content": "dd"}, user("w" * 10)])
    # 9 + 40 + 2 + 10 = 61 characters; a context of 52 holds 51: drop the first turn (20).
    messages, where, _ = cut(form, context=52)
    assert messages == [
        ("system", "Be brief."), ("user", "v" * 10), ("assistant", "b" * 10),
        ("developer", "dd"), ("user", "w" * 10),
    ]  # fmt: skip
    assert where == [None, 2, 3, 4, 5]  # errors still name the request's own input items
    messages, _, _ = cut(form, context=31)  # 30 fit: only the last turn and the system's
    assert [r for r, _ in messages] == ["system", "developer", "user"]


def test_a_call_and_its_result_go_with_their_turn() -> None:
    items = [user("x" * 10), CALL, {"type": "function_call_output", "call_id": "c1",
             "output": "sunny"}, assistant("it is sunny"), user("and tomorrow?")]  # fmt: skip
    messages, _, _ = cut(form_of(items, None), context=20)
    assert messages == [("user", "and tomorrow?")]  # never a tool's answer without its call


def test_a_last_turn_too_long_alone_is_refused_by_name() -> None:
    form = form_of([user("a"), assistant("b"), user("c" * 50)])
    with pytest.raises(InvalidRequest, match="truncation auto cannot") as err:
        cut(form, context=40)
    assert err.value.field == "input" and "does not fit the context of 40 tokens" in str(err.value)
    assert isinstance(err.value, ContextLengthExceeded)
    with pytest.raises(InvalidRequest, match="truncation auto cannot"):  # no turn to cut at
        cut(form_of([user("c" * 50)]), context=40)


def test_a_form_refused_before_counting_counts_as_too_long() -> None:
    """The tokenizer refuses a conversation of more characters than any context holds before
    counting it: truncation then cuts, as it does for one counted too long."""
    form = form_of([user("a" * 90), assistant("b"), user("c")])

    async def count(f: ChatForm) -> int:
        total = sum(len(m.content or "") for m in f.chat.messages)
        if total > 50:
            raise ContextLengthExceeded("prompt.chat", f"{total} characters cannot fit")
        return total

    kept = asyncio.run(truncated(form, count, 40))
    assert [m.content for m in kept.chat.messages] == ["Be brief.", "c"]


def test_bisection_counts_a_long_conversation_a_few_times() -> None:
    items = [t for i in range(200) for t in (user(f"q{i:03d}" * 3), assistant("r" * 12))]
    messages, _, counts = cut(form_of([*items, user("last")]), context=200)
    # 199 characters: the system's 9, "last" and 7 turns of 24 fit (q193 to q199), 8 do not
    assert messages[1] == ("user", "q193" * 3) and len(messages) == 1 + 14 + 1
    assert counts <= 12
