"""A chat completion's answer as OpenAI's Responses API gives it: the whole completion as a
response object (output items: reasoning, the message, function calls), and its streamed chunks
as the Responses events (an item added, its text's deltas, the item done, and the response
completed with its usage)."""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from engine.tokenizer import Tokenizer
from services.tokenizer.http.output import sse
from services.tokenizer.http.responses import ResponsesRequest

Event = dict[str, Any]


def event_sse(event: Event) -> str:
    """An event as OpenAI streams it: its type named on a line of its own, then its data."""
    return f"event: {event['type']}\n{sse(event)}"


class ResponseAnswer:
    def __init__(
        self, body: ResponsesRequest, request_id: str, model: str, tokenizer: Tokenizer
    ) -> None:
        self.body = body
        self.tokenizer = tokenizer
        self.reasoned = ""  # streamed: the reasoning's text so far
        self.id = f"resp_{request_id}"
        self.model = model
        self.created_at = int(time.time())
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # streamed: the output so far
        self.open: dict[str, Any] | None = None  # the reasoning or message item streaming
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.logprobs: list[dict[str, Any]] = []  # streamed: the tokens' not yet sent with text

    def response(self, status: str, output: list[dict[str, Any]], finish: str | None) -> Event:
        body = self.body
        tools = [{"type": "function", **t.model_dump(exclude={"type"})} for t in body.tools or []]
        choice = body.tool_choice
        fmt = body.text.format if body.text is not None else None
        incomplete = status == "incomplete" or (status == "completed" and finish == "length")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": "incomplete" if incomplete else status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "model": self.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None,
            "store": False,
            "temperature": body.temperature,
            "text": {"format": fmt.model_dump(by_alias=True) if fmt else {"type": "text"}},
            "tool_choice": choice.model_dump() if choice and not isinstance(choice, str)
            else choice or ("auto" if tools else "none"),
            "tools": tools,
            "top_p": body.top_p,
            "top_logprobs": body.top_logprobs,
            "truncation": body.truncation or "disabled",
            "usage": self.usage,
            "user": body.user,
        }  # fmt: skip

    def whole(self, completion: dict[str, Any]) -> Event:
        """The response to a whole chat completion."""
        (choice,) = completion["choices"]
        message = choice["message"]
        self.usage = self._usage(completion["usage"], message.get("reasoning_content") or "")
        output = []
        if message.get("reasoning_content"):
            output.append(_reasoning(message["reasoning_content"], "completed"))
        calls = message.get("tool_calls") or []
        if message.get("content") or not calls:
            item = _message(message.get("content") or "", "completed")
            item["content"][0]["logprobs"] = _logprobs(choice)
            output.append(item)
        output += [_call(c, "completed") for c in calls]
        return self.response("completed", output, choice["finish_reason"])

    # Streamed.

    def begin(self) -> list[Event]:
        created = self.response("in_progress", [], None)
        return [
            self._event("response.created", response=created),
            self._event("response.in_progress", response=created),
        ]

    def events(self, chunk: dict[str, Any]) -> list[Event]:
        """The Responses events of one chat chunk."""
        if chunk.get("usage"):
            self.usage = self._usage(chunk["usage"], self.reasoned)
        out: list[Event] = []
        for choice in chunk.get("choices", []):
            delta = choice["delta"]
            self.logprobs += _logprobs(choice)  # sent with the next text (or at its end)
            if reasoning := delta.get("reasoning_content"):
                self.reasoned += reasoning
                out += self._text("reasoning", reasoning)
            if content := delta.get("content"):
                out += self._text("message", content)
            for call in delta.get("tool_calls") or []:
                out += self._close()
                item = _call(call, "in_progress")
                out += self._add(item)
                at = {"item_id": item["id"], "output_index": len(self.items) - 1}
                arguments = item["arguments"]
                out.append(
                    self._event("response.function_call_arguments.delta", **at, delta=arguments)
                )
                out.append(
                    self._event("response.function_call_arguments.done", **at, arguments=arguments)
                )
                out += self._done(item)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return out

    def end(self) -> list[Event]:
        """What closes the stream: the open item done, then the response whole."""
        out = self._close()
        if not self.items:  # an empty reply is a message with no text, as OpenAI answers
            out += self._text("message", "") + self._close()
        response = self.response("completed", self.items, self.finish)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return [*out, self._event(kind, response=response)]

    def error(self, body: dict[str, Any]) -> Event:
        error = body["error"]
        return self._event(
            "error", code=error.get("code"), message=error["message"], param=error.get("param")
        )

    def _text(self, kind: str, text: str) -> list[Event]:
        out: list[Event] = []
        if self.open is None or self.open["type"] != kind:
            out += self._close()
            item = (
                _reasoning("", "in_progress")
                if kind == "reasoning"
                else _message("", "in_progress")
            )
            out += self._add(item)
            self.open = item
            part = dict(item["content"][0])
            out.append(self._event("response.content_part.added", **self._at(), part=part))
        assert self.open is not None
        self.open["content"][0]["text"] += text
        if not text:
            return out
        if kind == "reasoning":
            return [*out, self._event("response.reasoning_text.delta", **self._at(), delta=text)]
        logprobs, self.logprobs = self.logprobs, []
        self.open["content"][0]["logprobs"] += logprobs
        delta = self._event(
            "response.output_text.delta", **self._at(), delta=text, logprobs=logprobs
        )
        return [*out, delta]

    def _close(self) -> list[Event]:
        item, self.open = self.open, None
        if item is None:
            return []
        at = {"item_id": item["id"], "output_index": self.items.index(item), "content_index": 0}
        part = item["content"][0]
        if item["type"] == "reasoning":
            done = self._event("response.reasoning_text.done", **at, text=part["text"])
        else:
            part["logprobs"] += self.logprobs  # those of tokens that added no text
            self.logprobs = []
            done = self._event(
                "response.output_text.done", **at, text=part["text"], logprobs=part["logprobs"]
            )
        return [
            done,
            self._event("response.content_part.done", **at, part=dict(part)),
            *self._done(item),
        ]

    def _add(self, item: dict[str, Any]) -> list[Event]:
        self.items.append(item)
        added = json.loads(json.dumps(item))  # as it was then, not as it grows
        return [
            self._event("response.output_item.added", output_index=len(self.items) - 1, item=added)
        ]

    def _done(self, item: dict[str, Any]) -> list[Event]:
        item["status"] = "completed"
        index = self.items.index(item)
        return [self._event("response.output_item.done", output_index=index, item=item)]

    def _at(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1, "content_index": 0}

    def _usage(self, usage: dict[str, Any], reasoning: str) -> dict[str, Any]:
        details = usage.get("prompt_tokens_details") or {}
        # The reasoning's tokens are its text's, encoded again (its split is made on text).
        reasoned = len(self.tokenizer.encode(reasoning, allow_special=False)) if reasoning else 0
        return {
            "input_tokens": usage["prompt_tokens"],
            # What the prefix cache took in is the scheduler's to know, not counted here: 0.
            "input_tokens_details": {
                "cached_tokens": details.get("cached_tokens", 0),
                "cache_write_tokens": 0,
            },
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {
                "reasoning_tokens": min(reasoned, usage["completion_tokens"])
            },
            "total_tokens": usage["total_tokens"],
        }

    def _event(self, kind: str, **fields: Any) -> Event:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}


def _message(text: str, status: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": f"msg_{_suffix()}",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def _logprobs(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat choice's (or chunk's) token logprobs, as output_text's: the same fields."""
    return list((choice.get("logprobs") or {}).get("content") or [])


def _reasoning(text: str, status: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": f"rs_{_suffix()}",
        "status": status,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def _call(call: dict[str, Any], status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{_suffix()}",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": status,
    }


def _suffix() -> str:
    return secrets.token_hex(12)
