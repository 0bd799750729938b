"""A chat completion's answer as Anthropic's Messages API gives it: the whole completion as a
message (its content blocks: a reasoning model's thinking, the text, tool_use), and its streamed
chunks as the Messages events (message_start; each block's start, deltas and stop, in order;
message_delta with the stop reason and the usage; message_stop)."""

from __future__ import annotations

import json
from typing import Any

from services.tokenizer.http.errors import anthropic_error

Event = dict[str, Any]


class MessageAnswer:
    def __init__(self, request_id: str, model: str) -> None:
        self.id = f"msg_{request_id}"
        self.model = model
        # Streamed:
        self.started = False  # message_start sent
        self.blocks = 0  # content blocks started so far (the next one's index)
        self.open: str | None = None  # the kind of the text or thinking block streaming
        self.said = self.called = False  # text, tool calls sent
        self.finish: str | None = None
        self.stopped_by: dict[str, Any] = {}  # the finishing choice
        self.usage: dict[str, Any] = {}  # the chat's, the latest chunk's

    def message(
        self,
        content: list[Event],
        stop: str | None,
        usage: dict[str, Any],
        sequence: str | None = None,
    ) -> Event:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop,
            "stop_sequence": sequence,
            "usage": _usage(usage),
        }

    def whole(self, completion: dict[str, Any]) -> Event:
        """The message of a whole chat completion."""
        (choice,) = completion["choices"]
        message = choice["message"]
        content = []
        if message.get("reasoning_content"):
            thinking = message["reasoning_content"]
            content.append({"type": "thinking", "thinking": thinking, "signature": ""})
        calls = message.get("tool_calls") or []
        if message.get("content") or not calls:
            content.append({"type": "text", "text": message.get("content") or ""})
        content += [_tool_use(call) for call in calls]
        sequence = _stop_sequence(choice, bool(calls))
        stop = _stop_reason(choice["finish_reason"], bool(calls), sequence)
        return self.message(content, stop, completion["usage"], sequence)

    # Streamed.

    def begin(self) -> list[Event]:
        return []  # message_start waits for the first chunk: it tells the prompt's size

    def events(self, chunk: dict[str, Any]) -> list[Event]:
        """The Messages events of one chat chunk (each carries the usage so far)."""
        self.usage = chunk.get("usage") or self.usage
        out: list[Event] = []
        if not self.started:
            self.started = True
            out.append({"type": "message_start", "message": self.message([], None, self.usage)})
        for choice in chunk.get("choices", []):
            delta = choice["delta"]
            if reasoning := delta.get("reasoning_content"):
                out += self._text("thinking", reasoning)
            if content := delta.get("content"):
                self.said = True
                out += self._text("text", content)
            for call in delta.get("tool_calls") or []:
                self.called = True
                out += self._close()
                out.append(self._start({**_tool_use(call), "input": {}}))
                arguments = call["function"]["arguments"]
                json_delta = {"type": "input_json_delta", "partial_json": arguments}
                out.append(self._delta(json_delta))
                out.append(self._stop())
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
                self.stopped_by = choice
        return out

    def end(self) -> list[Event]:
        """What closes the stream: the open block stopped, the stop reason and usage, the end."""
        out = self._close()
        if not self.said and not self.called:  # an empty text, as the whole message has
            out += [self._start({"type": "text", "text": ""}), self._stop()]
        sequence = _stop_sequence(self.stopped_by, self.called)
        stop = _stop_reason(self.finish or "stop", self.called, sequence)
        return [
            *out,
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop, "stop_sequence": sequence},
                "usage": _usage(self.usage),
            },
            {"type": "message_stop"},
        ]

    def error(self, body: dict[str, Any]) -> Event:
        return anthropic_error(body)

    def _text(self, kind: str, text: str) -> list[Event]:
        out: list[Event] = []
        if self.open != kind:
            out += self._close()
            empty = {"text": ""} if kind == "text" else {"thinking": "", "signature": ""}
            out.append(self._start({"type": kind, **empty}))
            self.open = kind
        return [*out, self._delta({"type": f"{kind}_delta", kind: text})]

    def _close(self) -> list[Event]:
        if self.open is None:
            return []
        self.open = None
        return [self._stop()]

    def _start(self, block: Event) -> Event:
        self.blocks += 1
        return {"type": "content_block_start", "index": self.blocks - 1, "content_block": block}

    def _delta(self, delta: Event) -> Event:
        return {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}

    def _stop(self) -> Event:
        return {"type": "content_block_stop", "index": self.blocks - 1}


def _tool_use(call: dict[str, Any]) -> Event:
    function = call["function"]
    arguments = json.loads(function["arguments"])  # an object: held to the tool's input_schema
    return {"type": "tool_use", "id": call["id"], "name": function["name"], "input": arguments}


def _stop_sequence(choice: dict[str, Any], called: bool) -> str | None:
    """Which of stop_sequences ended a reply of text (a stop token id is not one)."""
    reason = choice.get("stop_reason")
    return reason if isinstance(reason, str) and not called else None


def _stop_reason(finish: str, called: bool, sequence: str | None) -> str:
    """A reply of tool calls stops for tool_use, whatever its finish (a call that tool_choice
    named finishes with "stop", as OpenAI's does)."""
    if called:
        return "tool_use"
    if sequence is not None:
        return "stop_sequence"
    return "max_tokens" if finish == "length" else "end_turn"


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    """The chat's usage as Anthropic counts it: the prompt's tokens found in the prefix cache
    apart from the others (known at the end; until then none). What the cache took in is the
    scheduler's to know, not counted here: 0."""
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": usage.get("prompt_tokens", 0) - cached,
        "output_tokens": usage.get("completion_tokens", 0),
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }
