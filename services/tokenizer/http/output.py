"""tandem's GenerateResponse messages → OpenAI's chunks (SSE) and whole responses, for chat and
completions. Written as dicts and serialized once per chunk: this is the per-token path."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from engine.tokenizer import Tokenizer
from tandem.v1 import generation_pb2 as pb


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse(obj: Any) -> str:
    return f"data: {_dumps(obj)}\n\n"


DONE = "data: [DONE]\n\n"


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    started: bool = False


class Output:
    """One HTTP request's answer, fed each message with its choice index."""

    object = ""
    chunk_object = ""

    def __init__(
        self,
        tokenizer: Tokenizer,
        response_id: str,
        model: str,
        n: int,
        top_logprobs: int | None,
        include_usage: bool,
        continuous_usage: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.n = n
        self.top = top_logprobs
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.generated = 0  # tokens so far, every choice
        self.choices: dict[int, _Choice] = {}
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0

    def _choice(self, index: int) -> _Choice:
        choice = self.choices.get(index)
        if choice is None:
            choice = self.choices[index] = _Choice()
        return choice

    def on_prompts(self, headers: list[pb.GenerateResponse]) -> None:
        """The first message of each prompt's call: its prompt's ids."""
        self.prompt_tokens = sum(len(h.prompt_token_ids) for h in headers)

    def _count(self, index: int, msg: pb.GenerateResponse) -> None:
        self.generated += len(msg.token_ids)
        if not msg.finish_reason:
            return
        self.completion_tokens += msg.usage.completion_tokens
        if index % self.n == 0:  # once per prompt
            self.cached_tokens += msg.usage.cached_prompt_tokens

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def usage_so_far(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.generated,
            "total_tokens": self.prompt_tokens + self.generated,
        }

    def _token(self, token_id: int) -> tuple[str, bytes]:
        raw = self.tokenizer.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), raw

    def _chunk(self, choices: list[dict[str, Any]], usage: Any = None) -> str:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            if usage is None and self.continuous_usage:
                usage = self.usage_so_far()
            chunk["usage"] = usage
        return sse(chunk)

    def stream(self, index: int, msg: pb.GenerateResponse) -> list[str]:
        """The SSE events for one message (none for one without text, logprobs or an end)."""
        self._count(index, msg)
        if not (msg.text or msg.logprobs or msg.finish_reason):
            return []
        return self._stream(index, msg)

    def last(self) -> list[str]:
        """What ends the stream: the usage chunk when asked for, then [DONE]."""
        tail = [self._chunk([], self.usage())] if self.include_usage else []
        return [*tail, DONE]

    def add(self, index: int, msg: pb.GenerateResponse) -> None:
        """For a whole response: take in one message."""
        self._count(index, msg)
        choice = self._choice(index)
        if msg.text:
            choice.text.append(msg.text)
        if msg.logprobs and self.top is not None:
            choice.logprobs.extend(msg.logprobs)
        if msg.finish_reason:
            choice.finish_reason = msg.finish_reason

    def _stream(self, index: int, msg: pb.GenerateResponse) -> list[str]:
        raise NotImplementedError

    def _logprobs(self, tokens: Any) -> dict[str, Any] | None:
        raise NotImplementedError

    def _content(self, choice: _Choice) -> dict[str, Any]:
        """A whole choice's output: a chat message, or a completion's text."""
        raise NotImplementedError

    def whole(self) -> dict[str, Any]:
        choices = [
            {
                "index": i,
                **self._content(c),
                "logprobs": self._logprobs(c.logprobs),
                "finish_reason": c.finish_reason,
            }
            for i, c in sorted(self.choices.items())
        ]
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
        }


class ChatOutput(Output):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def _logprobs(self, tokens: Any) -> dict[str, Any] | None:
        if self.top is None:
            return None
        content = []
        for t in tokens:
            text, raw = self._token(t.token_id)
            alternatives = []
            for alt in t.top_logprobs[: self.top]:
                alt_text, alt_raw = self._token(alt.token_id)
                alternatives.append(
                    {"token": alt_text, "logprob": alt.logprob, "bytes": list(alt_raw)}
                )
            content.append(
                {
                    "token": text,
                    "logprob": t.logprob,
                    "bytes": list(raw),
                    "top_logprobs": alternatives,
                }
            )
        return {"content": content}

    def _stream(self, index: int, msg: pb.GenerateResponse) -> list[str]:
        out = []
        choice = self._choice(index)
        if not choice.started:  # as OpenAI: the role first, with the first output
            choice.started = True
            delta = {"role": "assistant", "content": ""}
            out.append(self._chunk([{"index": index, "delta": delta, "finish_reason": None}]))
        body: dict[str, Any] = {
            "index": index,
            "delta": {"content": msg.text} if msg.text else {},
            "logprobs": self._logprobs(msg.logprobs),
            "finish_reason": msg.finish_reason or None,
        }
        out.append(self._chunk([body]))
        return out

    def _content(self, choice: _Choice) -> dict[str, Any]:
        return {"message": {"role": "assistant", "content": "".join(choice.text)}}


class CompletionOutput(Output):
    object = chunk_object = "text_completion"

    def _logprobs(self, tokens: Any) -> dict[str, Any] | None:
        if self.top is None:
            return None
        texts, lps, tops, offsets = [], [], [], []
        offset = 0
        for t in tokens:
            text, _ = self._token(t.token_id)
            texts.append(text)
            lps.append(t.logprob)
            tops.append({self._token(a.token_id)[0]: a.logprob for a in t.top_logprobs[: self.top]})
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": texts,
            "token_logprobs": lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _stream(self, index: int, msg: pb.GenerateResponse) -> list[str]:
        body = {
            "index": index,
            "text": msg.text,
            "logprobs": self._logprobs(msg.logprobs),
            "finish_reason": msg.finish_reason or None,
        }
        return [self._chunk([body])]

    def _content(self, choice: _Choice) -> dict[str, Any]:
        return {"text": "".join(choice.text)}
