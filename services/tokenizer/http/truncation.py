"""The Responses API's `truncation: "auto"`: where a conversation's prompt does not fit the
model's context, its oldest turns are dropped, as OpenAI does ("dropping items from the
beginning of the conversation"), until it does. Agents send it with every request so that a
long session goes on instead of failing.

What is kept: every system and developer message (and `instructions`), and the conversation
from a user message on, so that no template sees an answer without its question or a tool's
result without its call. The fewest turns are dropped: the cuts are tried by bisection, each
counted through the chat template as the request itself will be.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from engine.errors import ContextLengthExceeded
from services.tokenizer.http.responses import ChatForm

SYSTEM = ("system", "developer")


def _cut(form: ChatForm, at: int) -> ChatForm:
    """`form` without its non-system messages before message `at`."""
    messages = form.chat.messages
    kept = [k for k in range(len(messages)) if k >= at or messages[k].role in SYSTEM]
    chat = form.chat.model_copy(update={"messages": [messages[k] for k in kept]})
    return ChatForm(chat=chat, where=[form.where[k] for k in kept])


async def truncated(
    form: ChatForm, count: Callable[[ChatForm], Awaitable[int]], context: int
) -> ChatForm:
    """`form` as it is where its prompt leaves a token of the `context` to generate; else with
    the fewest oldest turns dropped that make it so. Raises ContextLengthExceeded naming
    `input` where even its last user turn onward does not fit."""
    limit = context - 1

    async def fits(cut: ChatForm) -> bool:
        try:
            return await count(cut) <= limit
        except ContextLengthExceeded:  # refused before it was counted: far too long
            return False

    if await fits(form):
        return form
    messages = form.chat.messages
    first = next((k for k, m in enumerate(messages) if m.role not in SYSTEM), len(messages))
    cuts = [k for k, m in enumerate(messages) if m.role == "user" and k > first]
    if not cuts or not await fits(_cut(form, cuts[-1])):
        raise ContextLengthExceeded(
            "input",
            f"the conversation does not fit the context of {context} tokens, and truncation "
            "auto cannot make it: the system messages and the last user turn onward alone "
            "do not fit",
        )
    low, high = 0, len(cuts) - 1  # cuts[high] fits; find the earliest cut that does
    while low < high:
        middle = (low + high) // 2
        if await fits(_cut(form, cuts[middle])):
            high = middle
        else:
            low = middle + 1
    return _cut(form, cuts[high])
