"""What the tandem client speaks: plain dataclasses, its one error, and the request it builds.

Shared by the async `TandemClient` and the blocking `Client` (their channel and Generate call too),
so both convert protobuf at the same edge. Nothing here imports the engine: a client needs grpc
and the generated protos only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypedDict, TypeVar, Unpack

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc

# The servers' limit too, so a long prompt's ids always fit in a message.
MAX_MESSAGE_BYTES = 64 << 20

Message = Mapping[str, str]  # {"role": "system" | "user" | "assistant" | "tool", "content": ...}


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
    n: int  # sequences from the prompt; each delta names its `index`
    stop: Sequence[str]
    stop_token_ids: Sequence[int]
    ignore_eos: bool
    priority: int
    session_id: str
    logprobs: int
    model: str
    request_id: str
    # Call options: seconds until the gRPC deadline, and extra metadata (e.g. a traceparent).
    timeout: float | None
    metadata: Sequence[tuple[str, str]]


_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
)


def generate_request(prompt: str | None, **options: Unpack[GenerateOptions]) -> pb.GenerateRequest:
    messages = options.get("messages")
    prompt_ids = options.get("prompt_ids")
    given = [
        name
        for name, value in (
            ("prompt", prompt),
            ("messages", messages),
            ("prompt_ids", prompt_ids),
        )
        if value is not None
    ]
    if len(given) != 1:
        raise ValueError(f"give exactly one of prompt, messages, prompt_ids (got {given or None})")
    request = pb.GenerateRequest(
        stop=options.get("stop", ()),
        stop_token_ids=options.get("stop_token_ids", ()),
        ignore_eos=options.get("ignore_eos", False),
        priority=options.get("priority", 0),
        session_id=options.get("session_id", ""),
        logprobs=options.get("logprobs", 0),
        model=options.get("model", ""),
        request_id=options.get("request_id", ""),
        min_tokens=options.get("min_tokens", 0),
        n=options.get("n", 1),
    )
    if prompt is not None:
        request.text = prompt
    elif messages is not None:
        request.chat.CopyFrom(chat_to_pb(messages))
    elif prompt_ids is not None:
        request.token_ids.ids.extend(prompt_ids)
    for name in _SAMPLING_FIELDS:
        value = options.get(name)
        if value is not None:
            setattr(request.sampling, name, value)
    request.sampling.logit_bias.update(options.get("logit_bias", {}))
    max_tokens = options.get("max_tokens")
    if max_tokens is not None:
        request.max_tokens = max_tokens
    return request


def call_metadata(
    options: GenerateOptions, api_key: str | None = None
) -> tuple[tuple[str, str], ...] | None:
    extra = tuple(options.get("metadata") or ())
    if api_key:
        extra += (("authorization", f"Bearer {api_key}"),)
    return extra or None


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
            if not path:
                return None
            with open(path, "rb") as f:
                return f.read()

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ssl_ca_certs),
            private_key=read(self.ssl_keyfile),
            certificate_chain=read(self.ssl_certfile),
        )

    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else None


def chat_to_pb(messages: Sequence[Message]) -> pb.ChatMessages:
    return pb.ChatMessages(
        messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages]
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
class Delta:
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None  # set on the last delta only, with usage
    usage: Usage | None = None
    index: int = 0  # which of the request's n sequences

    @classmethod
    def from_pb(cls, msg: pb.GenerateResponse) -> Delta:
        return cls(
            index=msg.index,
            text=msg.text,
            token_ids=tuple(msg.token_ids),
            logprobs=tuple(TokenLogprob.from_pb(t) for t in msg.logprobs),
            finish_reason=msg.finish_reason or None,
            usage=Usage.from_pb(msg.usage) if msg.finish_reason else None,
        )


@dataclass
class Choice:
    """One of a generation's n sequences, filled in as its deltas arrive."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # None until its last message arrived
    usage: Usage | None = None

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.finish_reason:
            self.finish_reason = delta.finish_reason
            self.usage = delta.usage


@dataclass
class GenerationResult:
    """The totals of one generation, filled in as its messages arrive. The text, tokens and
    finish of its first sequence are its own fields; `choices` holds all n."""

    request_id: str = ""
    trace_id: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    n: int = 1
    choices: list[Choice] = field(default_factory=list)

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


def tokenize_request(
    text: str | None, messages: Sequence[Message] | None, model: str
) -> pb.TokenizeRequest:
    if (text is None) == (messages is None):
        raise ValueError("give exactly one of text, messages")
    if messages is not None:
        return pb.TokenizeRequest(chat=chat_to_pb(messages), model=model)
    return pb.TokenizeRequest(text=text, model=model)


def not_ready(err: grpc.RpcError, address: str, timeout: float) -> TandemError:
    error = TandemError.from_rpc(err)
    if error.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TandemError(error.code, f"{address} was not ready within {timeout:g} s")
    return error


class GenerationBase:
    """What a message read, the stream's end or its error does to a Generate call's totals."""

    def __init__(self, call: Any, n: int = 1) -> None:
        self._call = call
        self._done = False
        self.result = GenerationResult(n=n)

    def _take(self, msg: pb.GenerateResponse | None) -> Delta | None:
        """One message read (None: the stream ended with OK); the delta it carries, if any."""
        if msg is None:
            self._done = True
            self.result.check_finished()
            return None
        return self.result.add(msg)

    def _failed(self, err: grpc.RpcError) -> TandemError:
        self._done = True
        return TandemError.from_rpc(err)

    def cancel(self) -> None:
        if not self._done:
            self._done = True
            self._call.cancel()


G = TypeVar("G", bound=GenerationBase)


class ClientBase(Generic[G]):
    """One channel to a tandem server. `channels`: `grpc.aio` or `grpc` (the same constructors);
    `generation`: the class that reads a Generate call made on it."""

    channels: Any
    generation: type[G]

    def __init__(
        self, address: str, api_key: str | None = None, connection: Connection | None = None
    ) -> None:
        """`api_key`: sent as `authorization: Bearer KEY`; `connection`: TLS (and a key)."""
        self.address = address
        self.connection = connection or Connection()
        self._api_key = api_key or self.connection.api_key
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        if self.connection.secure:
            credentials = self.connection.credentials()
            self._channel = self.channels.secure_channel(address, credentials, options)
        else:
            self._channel = self.channels.insecure_channel(address, options)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def generate(self, prompt: str | None = None, **options: Unpack[GenerateOptions]) -> G:
        """Start a generation (the call begins at once; iterate the result to read it)."""
        request = generate_request(prompt, **options)
        call = self._stub.Generate(
            request, timeout=options.get("timeout"), metadata=call_metadata(options, self._api_key)
        )
        return self.generation(call, request.n or 1)

    def _watch(self, timeout: float, service: str) -> Any:
        # Watch, not a loop of Checks: the server pushes each change, and wait_for_ready rides
        # out a server that is not listening yet.
        request = health_pb2.HealthCheckRequest(service=service)
        return self._health.Watch(request, timeout=timeout, wait_for_ready=True)

    def _metadata(self) -> tuple[tuple[str, str], ...] | None:
        return call_metadata({}, self._api_key)
