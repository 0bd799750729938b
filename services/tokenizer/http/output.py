"""tandem's GenerateResponse messages → OpenAI's chunks (SSE) and whole responses, for chat and
completions. Written as dicts and serialized once per chunk: this is the per-token path."""

from __future__ import annotations

import itertools
import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from engine.tokenizer import Tokenizer
from services.client_types import stopped_by
from services.tokenizer.http.convert import Plan
from services.tokenizer.http.reasoning import OPEN as THINK
from services.tokenizer.http.reasoning import ReasoningSplit
from tandem.v1 import generation_pb2 as pb


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the request's own stop that ended it (vLLM's)
    started: bool = False
    held: bool = False  # its text is tool calls, sent whole at the end
    decided: bool = False  # (tool_choice "auto") whether its text is calls is known
    offset: int = 0  # (completions, streamed) characters its chunks' logprobs covered so far
    split: ReasoningSplit | None = None  # (a reasoning model's chat) its text's two parts


class Output:
    """One HTTP request's answer (chat or completions, as its plan says), fed each message with
    its choice index."""

    def __init__(self, tokenizer: Tokenizer, response_id: str, model: str, plan: Plan) -> None:
        self.tokenizer = tokenizer
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.plan = plan
        self.chat = plan.chat
        self.object = "chat.completion" if plan.chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if plan.chat else "text_completion"
        self.generated = 0  # tokens so far, every choice
        self.choices: defaultdict[int, _Choice] = defaultdict(_Choice)
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0
        self.prompt_ids: list[list[int]] = []  # each prompt's
        # Each scored prompt's tokens from the second on (the first sequence of it brings them).
        self.prompt_scores: dict[int, list[pb.PromptTokenLogprob]] = {}

    def on_prompts(self, headers: list[pb.GenerateResponse]) -> None:
        """The first message of each prompt's call: its prompt's ids."""
        self.prompt_ids = [list(h.prompt_token_ids) for h in headers]
        self.prompt_tokens = sum(map(len, self.prompt_ids))

    def _count(self, index: int, msg: pb.GenerateResponse) -> None:
        if msg.prompt_logprobs:
            self.prompt_scores[index // self.plan.n] = list(msg.prompt_logprobs)
        if not self.plan.generates:  # max_tokens 0: what was generated is not answered
            return
        self.generated += len(msg.token_ids)
        if not msg.finish_reason:
            return
        self.choices[index].stop_reason = stopped_by(msg)
        self.completion_tokens += msg.usage.completion_tokens
        if index % self.plan.n == 0:  # once per prompt
            self.cached_tokens += msg.usage.cached_prompt_tokens

    def usage(self, so_far: bool = False) -> dict[str, Any]:
        """The request's usage; `so_far`: while it streams (vLLM's continuous_usage_stats)."""
        completion = self.generated if so_far else self.completion_tokens
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }
        if not so_far:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage

    def _body(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _chunk(self, choices: list[dict[str, Any]], usage: Any = None) -> dict[str, Any]:
        chunk = self._body(self.chunk_object, choices)
        if self.plan.include_usage:
            if usage is None and self.plan.continuous_usage:
                usage = self.usage(so_far=True)
            chunk["usage"] = usage
        return chunk

    def stream(self, index: int, msg: pb.GenerateResponse) -> list[str]:
        """The SSE events for one message (none for one without text, logprobs or an end)."""
        return [sse(chunk) for chunk in self.chunks(index, msg)]

    def last(self) -> list[str]:
        """What ends the stream: the usage chunk when asked for, then [DONE]."""
        return [*(sse(chunk) for chunk in self.last_chunks()), DONE]

    def last_chunks(self) -> list[dict[str, Any]]:
        return [self._chunk([], self.usage())] if self.plan.include_usage else []

    def chunks(self, index: int, msg: pb.GenerateResponse) -> list[dict[str, Any]]:
        """The streamed chunks of one message (none for one without text, logprobs or an end)."""
        self._count(index, msg)
        out = []
        choice = self.choices[index]
        if self.plan.echo and not choice.started and (msg.token_ids or msg.finish_reason):
            # The prompt first, in a chunk of its own, once its scores are in (they come with
            # the first tokens).
            choice.started = True
            text, logprobs = self._echo(index // self.plan.n)
            choice.offset = len(text)
            out.append(self._chunk([_text_chunk(index, text, logprobs, None)]))
        if not self.plan.generates:
            msg = pb.GenerateResponse(finish_reason=msg.finish_reason)
        if not (msg.text or msg.logprobs or msg.finish_reason):
            return out
        finish = msg.finish_reason or None
        if self.chat:
            return out + self._chat_chunks(index, choice, msg.text, finish, msg.logprobs)
        logprobs = self._logprobs(msg.logprobs, choice.offset)
        choice.offset += len(msg.text)
        body = _text_chunk(index, msg.text, logprobs, finish)
        if finish:
            body["stop_reason"] = choice.stop_reason
        out.append(self._chunk([body]))
        return out

    def _chat_chunks(
        self, index: int, choice: _Choice, text: str, finish: str | None, tokens: Any
    ) -> list[dict[str, Any]]:
        out = []
        if not choice.started:  # as OpenAI: the role first, with the first output
            choice.started = True
            choice.held = self.plan.calls is not None and not self.plan.calls.auto
            delta = {"role": "assistant", "content": None if choice.held else self.plan.chat_echo}
            out.append(self._chunk([{"index": index, "delta": delta, "finish_reason": None}]))
        calls = self.plan.calls
        if calls is not None and not choice.decided and (text or finish):
            # "auto": a reply is calls or text as its beginning says (its grammar's), which may
            # take a marker's few tokens; until then its text is held back.
            choice.text.append(text)
            text = "".join(choice.text)
            verdict = calls.verdict(text)
            if verdict is None and not finish:
                waiting = {"index": index, "delta": {}, "logprobs": self._logprobs(tokens)}
                return [*out, self._chunk([{**waiting, "finish_reason": None}])]
            choice.held, choice.decided = bool(verdict), True
            choice.text.clear()
        reasoning = ""
        if self.plan.reasoning:
            reasoning, text = self._split(choice, text, bool(finish))
        body: dict[str, Any] = {"index": index, "delta": {"content": text} if text else {}}
        if reasoning:
            body["delta"]["reasoning_content"] = reasoning
        if choice.held:
            # The calls are sent whole, once their JSON is: held until the end.
            choice.text.append(text)
            body["delta"] = {}
            if finish:
                message, finish = self._message("".join(choice.text), finish)
                body["delta"] = {k: v for k, v in message.items() if k != "role"}
                if "tool_calls" in body["delta"]:
                    listed = body["delta"]["tool_calls"]
                    body["delta"]["tool_calls"] = [{"index": i, **c} for i, c in enumerate(listed)]
        body["logprobs"] = self._logprobs(tokens)
        body["finish_reason"] = finish
        if finish:
            body["stop_reason"] = choice.stop_reason
        out.append(self._chunk([body]))
        return out

    def add(self, index: int, msg: pb.GenerateResponse) -> None:
        """For a whole response: take in one message."""
        self._count(index, msg)
        choice = self.choices[index]
        if msg.finish_reason:
            choice.finish_reason = msg.finish_reason
        if not self.plan.generates:
            return
        if msg.text:
            choice.text.append(msg.text)
        if msg.logprobs and self.plan.top_logprobs is not None:
            choice.logprobs.extend(msg.logprobs)

    def whole(self) -> dict[str, Any]:
        choices = []
        for i, c in sorted(self.choices.items()):
            text = "".join(c.text)
            finish = c.finish_reason
            logprobs = self._logprobs(c.logprobs)
            if self.chat:
                reasoning = ""
                if self.plan.reasoning:
                    reasoning, text = self._split(c, text, True)
                message, finish = self._message(self.plan.chat_echo + text, finish or "")
                if self.plan.reasoning:
                    message["reasoning_content"] = reasoning or None
                content: dict[str, Any] = {"message": message}
            elif self.plan.echo:
                prompt, prompt_logprobs = self._echo(i // self.plan.n)
                content = {"text": prompt + text}
                logprobs = _joined(prompt_logprobs, logprobs)
            else:
                content = {"text": text}
            choice = {
                "index": i,
                **content,
                "logprobs": logprobs,
                "finish_reason": finish,
                "stop_reason": c.stop_reason,
            }
            if self.plan.prompt_logprobs is not None and not self.chat:
                choice["prompt_logprobs"] = self._vllm_prompt_logprobs(i // self.plan.n)
            choices.append(choice)
        body = {**self._body(self.object, choices), "usage": self.usage()}
        if self.plan.prompt_logprobs is not None and self.chat:
            body["prompt_logprobs"] = self._vllm_prompt_logprobs(0)
        return body

    def _echo(self, prompt: int) -> tuple[str, dict[str, Any] | None]:
        """An echoed prompt's text (as given, or its ids decoded) and its completions logprobs:
        its first token has none, and the others' the scores its first sequence brought."""
        request = self.plan.requests[prompt]
        ids = self.prompt_ids[prompt]
        # (a truncated prompt is what was run: its ids')
        given = request.WhichOneof("prompt") == "text" and not request.truncate_prompt_tokens
        text = request.text if given else self.tokenizer.decode(ids)
        top = self.plan.top_logprobs
        if top is None:
            return text, None
        scores = self.prompt_scores.get(prompt, [])
        texts = [self._text(t) for t in ids]
        return text, {
            "tokens": [self._name(t) for t in ids],
            "token_logprobs": [None, *(e.logprob for e in scores)],
            "top_logprobs": [
                None,
                *(
                    {self._name(a.token_id): a.logprob for a in e.top_logprobs[:top]}
                    for e in scores
                ),
            ],
            "text_offset": _offsets(texts),
        }

    def _vllm_prompt_logprobs(self, prompt: int) -> list[dict[str, Any] | None]:
        """vLLM's prompt_logprobs: None for the first token; then by token id, the token's own
        logprob and rank and its alternatives' (ranked 1, 2, ...)."""
        top = self.plan.prompt_logprobs or 0
        out: list[dict[str, Any] | None] = [None]
        for e in self.prompt_scores.get(prompt, []):
            ranked = {
                str(a.token_id): {
                    "logprob": a.logprob,
                    "rank": rank,
                    "decoded_token": self._text(a.token_id),
                }
                for rank, a in enumerate(e.top_logprobs[:top], start=1)
            }
            own = {"logprob": e.logprob, "rank": e.rank, "decoded_token": self._text(e.token_id)}
            out.append({str(e.token_id): own, **ranked})
        return out

    def _message(self, text: str, finish: str) -> tuple[dict[str, Any], str]:
        """A chat reply's message and finish reason: with tool calls asked for, a text that
        ended by itself is the calls (held to their JSON); one cut short stays text."""
        calls = self.plan.calls
        functions = calls.read(text) if calls is not None and finish == "stop" else None
        if functions is None:
            return {"role": "assistant", "content": text}, finish
        assert calls is not None
        listed = [
            {
                "id": f.get("id") or calls.form.call_id(),  # the model's own, where it writes one
                "type": "function",
                "function": {"name": f["name"], "arguments": f["arguments"]},
            }
            for f in functions
        ]
        # OpenAI ends a call that tool_choice named with "stop".
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": listed,
        }, "stop" if calls.function is not None else "tool_calls"

    def _split(self, choice: _Choice, text: str, ended: bool) -> tuple[str, str]:
        """A reasoning model's text as (reasoning, content), the reply so far or whole."""
        if choice.split is None:
            ids = self.prompt_ids[0] if self.prompt_ids else []
            # A generation prompt that ends with <think> (DeepSeek-R1's) has it reason first.
            opened = self.tokenizer.decode(ids[-8:]).rstrip().endswith(THINK)
            choice.split = ReasoningSplit(opened)
        reasoning, content = choice.split.feed(text)
        if ended:
            more, rest = choice.split.flush()
            reasoning, content = reasoning + more, content + rest
        return reasoning, content

    def _text(self, token_id: int) -> str:
        return self.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")

    def _name(self, token_id: int) -> str:
        """How logprobs name a token: its text, or "token_id:<id>" where asked (its text may
        be a piece of a character, or the same as another token's)."""
        return f"token_id:{token_id}" if self.plan.token_ids_as_text else self._text(token_id)

    def _chat_token(self, token: pb.GeneratedToken | pb.TokenLogprob) -> dict[str, Any]:
        raw = self.tokenizer.token_bytes(token.token_id)  # its own bytes, however it is named
        return {"token": self._name(token.token_id), "logprob": token.logprob, "bytes": list(raw)}

    def _logprobs(self, tokens: Any, offset: int = 0) -> dict[str, Any] | None:
        """offset: (completions) where the tokens' text begins in the choice's."""
        top = self.plan.top_logprobs
        if top is None:
            return None
        if self.chat:
            content = []
            for t in tokens:
                alternatives = [self._chat_token(a) for a in t.top_logprobs[:top]]
                content.append({**self._chat_token(t), "top_logprobs": alternatives})
            return {"content": content}
        texts = [self._text(t.token_id) for t in tokens]  # (where they begin: by their text)
        return {
            "tokens": [self._name(t.token_id) for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [
                {self._name(a.token_id): a.logprob for a in t.top_logprobs[:top]} for t in tokens
            ],
            "text_offset": _offsets(texts, offset),
        }


def _offsets(texts: list[str], start: int = 0) -> list[int]:
    """Where each token's text begins."""
    return list(itertools.accumulate(map(len, texts), initial=start))[:-1]


def _text_chunk(
    index: int, text: str, logprobs: dict[str, Any] | None, finish: str | None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def _joined(prompt: dict[str, Any] | None, generated: dict[str, Any] | None) -> Any:
    """Completions logprobs of an echoed prompt, then of the tokens generated after it."""
    if prompt is None or generated is None:
        return prompt or generated
    texts = prompt["tokens"] + generated["tokens"]
    return {
        "tokens": texts,
        "token_logprobs": prompt["token_logprobs"] + generated["token_logprobs"],
        "top_logprobs": prompt["top_logprobs"] + generated["top_logprobs"],
        "text_offset": _offsets(texts),
    }
