"""What the tandem client speaks: plain dataclasses, its one error, and the request it builds.

Shared by the async `TandemClient` and the blocking `Client`, so both convert protobuf at the
same edge. Nothing here imports the engine: a client needs grpc and the generated protos only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict, Unpack

import grpc

from tandem.v1 import generation_pb2 as pb

# The servers' limit too, so a long prompt's ids always fit in a message.
MAX_MESSAGE_BYTES = 64 << 20

# {"role": "system" | "user" | "assistant" | "tool", "content": ...}; an assistant's earlier
# "tool_calls" (OpenAI's form, each function's arguments an object) for a chat template that
# shows them, and a tool's "tool_call_id".
Message = Mapping[str, Any]


class InvalidOption(ValueError):
    """An option no request can carry (a seed below 0, a priority past 32 bits), named; raised
    before anything is sent."""


class TandemError(Exception):
    """A failed RPC: its status code and the server's message, unchanged."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc(cls, err: grpc.RpcError) -> TandemError:
        # What the sync API raises is also a grpc.Call; aio.AioRpcError has the same two methods.
        code: grpc.StatusCode = err.code()
        return cls(code, err.details() or code.name)


class GenerateOptions(TypedDict, total=False):
    # Exactly one prompt: the positional text, `messages` (chat template) or `prompt_ids`.
    messages: Sequence[Message]
    prompt_ids: Sequence[int]
    # How `messages` are rendered (ChatMessages): the last one left open for the model to
    # continue; the assistant's turn opened (default: true, false when continuing); more of
    # the template's variables.
    continue_final_message: bool
    add_generation_prompt: bool | None
    chat_template_kwargs: Mapping[str, Any]
    # Sampling; None or left out takes the server's default (temperature 1, the rest off).
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    repetition_penalty: float | None
    presence_penalty: float | None
    frequency_penalty: float | None
    seed: int | None
    max_tokens: int | None  # None: up to 256, within the context
    min_tokens: int  # no stop token or stop string ends a sequence before this many tokens
    logit_bias: Mapping[int, float]  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: Sequence[int]  # only these may be sampled (an end of sequence too)
    # What the output is held to, as the request's OutputFormat or a dict of it:
    # {"json_schema": json.dumps(schema)}, {"json_object": True}, {"regex": "[0-9]+"} or
    # {"choice": {"choices": ["yes", "no"]}} or {"grammar": lark_or_gbnf_text}.
    output_format: pb.OutputFormat | Mapping[str, Any]
    n: int  # sequences from the prompt; each delta names its `index`
    stop: Sequence[str]
    stop_token_ids: Sequence[int]
    bad_words: Sequence[str]  # words the output may not contain
    ignore_eos: bool
    priority: int
    session_id: str
    logprobs: int
    # Score the prompt: each of its tokens from the second on gets its logprob, rank and this
    # many alternatives (GenerationResult.prompt_logprobs); None: not scored.
    prompt_logprobs: int | None
    skip_special_tokens: bool | None  # False keeps special tokens' text; None: the default, True
    include_stop_str_in_output: bool  # the stop string that ended a sequence stays in its text
    truncate_prompt_tokens: int  # run only the prompt's last this many tokens; -1: what fits
    model: str
    request_id: str
    # Call options: seconds until the gRPC deadline, and extra metadata (e.g. a traceparent).
    timeout: float | None
    metadata: Sequence[tuple[str, str]]


# Options named as the request's fields (or its sampling's) are copied as they are.
_REQUEST_FIELDS = frozenset(pb.GenerateRequest.DESCRIPTOR.fields_by_name)
_SAMPLING_FIELDS = frozenset(pb.SamplingParams.DESCRIPTOR.fields_by_name)


def generate_request(prompt: str | None, **options: Unpack[GenerateOptions]) -> pb.GenerateRequest:
    messages = options.get("messages")
    prompt_ids = options.get("prompt_ids")
    prompts = {"prompt": prompt, "messages": messages, "prompt_ids": prompt_ids}
    given = [name for name, value in prompts.items() if value is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of prompt, messages, prompt_ids (got {given or None})")
    rendering = ("continue_final_message", "add_generation_prompt", "chat_template_kwargs")
    if messages is None and (named := [k for k in rendering if options.get(k) is not None]):
        raise InvalidOption(f"{named[0]}: renders messages; give messages")
    values: dict[str, Any] = {k: v for k, v in options.items() if v is not None}
    fields = {"n": 1, **{k: v for k, v in values.items() if k in _REQUEST_FIELDS}}
    if sampling := {k: v for k, v in values.items() if k in _SAMPLING_FIELDS}:
        fields["sampling"] = _message(pb.SamplingParams, sampling)
    request = _message(pb.GenerateRequest, fields)
    if prompt is not None:
        request.text = prompt
    elif messages is not None:
        request.chat.CopyFrom(chat_to_pb(messages))
        request.chat.continue_final_message = bool(options.get("continue_final_message"))
        if (opened := options.get("add_generation_prompt")) is not None:
            request.chat.add_generation_prompt = opened
        if variables := options.get("chat_template_kwargs"):
            request.chat.chat_template_kwargs = json.dumps(variables, ensure_ascii=False)
    elif prompt_ids is not None:
        request.token_ids.ids.extend(prompt_ids)
    return request


def _message(kind: Any, fields: dict[str, Any]) -> Any:
    """`kind(**fields)`; InvalidOption naming the field protobuf refuses (its own error names
    none: "Value out of range: -1")."""
    try:
        return kind(**fields)
    except (ValueError, TypeError):
        for name, value in fields.items():
            try:
                kind(**{name: value})
            except (ValueError, TypeError) as err:
                raise InvalidOption(f"{name}: {err}") from None
        raise


@dataclass(frozen=True)
class Connection:
    """How a client reaches a server: an API key, and TLS (`ssl_ca_certs` the CA that signed the
    server's certificate, or the system's with `tls`; a certificate of its own where the server
    asks for one)."""

    api_key: str | None = None
    tls: bool = False
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None

    @property
    def secure(self) -> bool:
        return self.tls or bool(self.ssl_ca_certs or self.ssl_certfile)

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: str | None) -> bytes | None:
            return Path(path).read_bytes() if path else None

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ssl_ca_certs),
            private_key=read(self.ssl_keyfile),
            certificate_chain=read(self.ssl_certfile),
        )


def chat_to_pb(messages: Sequence[Message]) -> pb.ChatMessages:
    return pb.ChatMessages(messages=[_message_pb(m) for m in messages])


def _message_pb(message: Message) -> pb.ChatMessage:
    calls = message.get("tool_calls")
    return pb.ChatMessage(
        role=message["role"],
        content=message.get("content") or "",
        tool_calls=json.dumps(list(calls), ensure_ascii=False) if calls else "",
        tool_call_id=message.get("tool_call_id") or "",
    )


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0

    @classmethod
    def from_pb(cls, msg: pb.Usage) -> Usage:
        return cls(msg.prompt_tokens, msg.completion_tokens, msg.cached_prompt_tokens)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob) of the most likely alternatives

    @classmethod
    def from_pb(cls, msg: pb.GeneratedToken) -> TokenLogprob:
        return cls(
            msg.token_id, msg.logprob, tuple((t.token_id, t.logprob) for t in msg.top_logprobs)
        )


@dataclass(frozen=True)
class PromptTokenLogprob:
    """A prompt token, scored given the tokens before it."""

    token_id: int
    logprob: float
    rank: int  # 1: the model's most likely token there
    top: tuple[tuple[int, float], ...] = ()

    @classmethod
    def from_pb(cls, msg: pb.PromptTokenLogprob) -> PromptTokenLogprob:
        top = tuple((t.token_id, t.logprob) for t in msg.top_logprobs)
        return cls(msg.token_id, msg.logprob, msg.rank, top)


@dataclass(frozen=True)
class Delta:
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    # With a sequence's first tokens, where the prompt was scored: its tokens from the second on.
    prompt_logprobs: tuple[PromptTokenLogprob, ...] = ()
    finish_reason: str | None = None  # set on the last delta only, with usage
    usage: Usage | None = None
    index: int = 0  # which of the request's n sequences
    # The last delta's, where one of the request's stop strings or stop_token_ids ended it.
    stop_reason: str | int | None = None

    @classmethod
    def from_pb(cls, msg: pb.GenerateResponse) -> Delta:
        return cls(
            index=msg.index,
            text=msg.text,
            token_ids=tuple(msg.token_ids),
            logprobs=tuple(TokenLogprob.from_pb(t) for t in msg.logprobs),
            prompt_logprobs=tuple(PromptTokenLogprob.from_pb(t) for t in msg.prompt_logprobs),
            finish_reason=msg.finish_reason or None,
            usage=Usage.from_pb(msg.usage) if msg.finish_reason else None,
            stop_reason=stopped_by(msg),
        )


def stopped_by(msg: pb.GenerateResponse) -> str | int | None:
    """The request's stop string or stop token id that ended a sequence, from its last message."""
    which = msg.WhichOneof("stopped_by")
    return None if which is None else getattr(msg, which)


@dataclass
class Choice:
    """One of a generation's n sequences, filled in as its deltas arrive."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # None until its last message arrived
    usage: Usage | None = None
    stop_reason: str | int | None = None  # the request's own stop that ended it

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.finish_reason:
            self.finish_reason = delta.finish_reason
            self.usage = delta.usage
            self.stop_reason = delta.stop_reason


@dataclass
class GenerationResult:
    """The totals of one generation, filled in as its messages arrive. The text, tokens and
    finish of its first sequence are its own fields; `choices` holds all n."""

    request_id: str = ""
    trace_id: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    n: int = 1
    choices: list[Choice] = field(default_factory=list)
    # Where prompt_logprobs was asked for: one per prompt token from the second on.
    prompt_logprobs: list[PromptTokenLogprob] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.choices = [Choice() for _ in range(self.n)]

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def logprobs(self) -> list[TokenLogprob]:
        return self.choices[0].logprobs

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason

    @property
    def usage(self) -> Usage | None:
        return self.choices[0].usage

    @property
    def stop_reason(self) -> str | int | None:
        return self.choices[0].stop_reason

    def add(self, msg: pb.GenerateResponse) -> Delta | None:
        """Take in one message; the delta it carries, or None for the header-only first one."""
        if msg.request_id:
            self.request_id = msg.request_id
        if msg.trace_id:
            self.trace_id = msg.trace_id
        self.prompt_token_ids.extend(msg.prompt_token_ids)
        if not (msg.text or msg.token_ids or msg.finish_reason):
            return None
        delta = Delta.from_pb(msg)
        if not 0 <= delta.index < len(self.choices):
            raise TandemError(grpc.StatusCode.INTERNAL, f"a delta of sequence {delta.index}")
        self.choices[delta.index].add(delta)
        self.prompt_logprobs.extend(delta.prompt_logprobs)
        return delta

    def check_finished(self) -> None:
        # A stream that closes with OK but no finish reason is a server bug; say so, not hang.
        if any(c.finish_reason is None for c in self.choices):
            raise TandemError(grpc.StatusCode.INTERNAL, "the stream ended without a finish reason")


@dataclass(frozen=True)
class ModelInfo:
    name: str
    context_length: int
    vocab_size: int
    weight_format: str
    device: str
    dtype: str

    @classmethod
    def from_pb(cls, msg: pb.ModelInfo) -> ModelInfo:
        return cls(
            msg.name, msg.context_length, msg.vocab_size, msg.weight_format, msg.device, msg.dtype
        )
