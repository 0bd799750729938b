"""What the async `TandemClient` and the blocking `Client` share: the channel, its calls, and
what reading a Generate call does to its totals."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar, Unpack

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.client_types import (
    MAX_MESSAGE_BYTES,
    Connection,
    Delta,
    GenerateOptions,
    GenerationResult,
    Message,
    ModelInfo,
    TandemError,
    chat_to_pb,
    generate_request,
)
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc

# A health watch the server cut (it is stopping, or restarting) is watched again after a pause
# until the deadline: waiting for ready rides out a restart, as wait_for_ready rides out a server
# that is not listening yet.
_CUT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
REWATCH_S = 0.1


def answers_not_in_grpc(err: TandemError) -> bool:
    """Whether the channel reached a server that does not speak gRPC (HTTP/2): most often
    tandem's own OpenAI-compatible HTTP port given where its gRPC address belongs."""
    return err.code == grpc.StatusCode.UNAVAILABLE and "Failed parsing HTTP/2" in err.message


def not_ready(address: str, timeout: float) -> TandemError:
    return TandemError(
        grpc.StatusCode.DEADLINE_EXCEEDED, f"{address} was not ready within {timeout:g} s"
    )


def watch_again(err: grpc.RpcError, address: str, timeout: float) -> None:
    """Return when a health watch that failed so is to be watched again; else raise its error."""
    error = TandemError.from_rpc(err)
    if error.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        raise not_ready(address, timeout) from None
    if error.code not in _CUT:
        raise error from None


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
        metadata = self._metadata(options.get("metadata") or ())
        call = self._stub.Generate(request, timeout=options.get("timeout"), metadata=metadata)
        return self.generation(call, request.n or 1)

    # The unary calls: the value itself from `Client`, an awaitable of it from `TandemClient`.
    def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Sequence[Message] | None = None,
        model: str = "",
        timeout: float | None = None,
    ) -> Any:
        """The token ids (`list[int]`) of a text, or of `messages` in the chat template."""
        if (text is None) == (messages is None):
            raise ValueError("give exactly one of text, messages")
        if messages is not None:
            request = pb.TokenizeRequest(chat=chat_to_pb(messages), model=model)
        else:
            request = pb.TokenizeRequest(text=text, model=model)
        return self._unary(self._stub.Tokenize, request, timeout, lambda r: list(r.token_ids))

    def detokenize(
        self,
        token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = False,
        model: str = "",
        timeout: float | None = None,
    ) -> Any:
        """The text (`str`) of token ids."""
        request = pb.DetokenizeRequest(
            token_ids=token_ids, skip_special_tokens=skip_special_tokens, model=model
        )
        return self._unary(self._stub.Detokenize, request, timeout, lambda r: str(r.text))

    def list_models(self, *, timeout: float | None = None) -> Any:
        """The models the server serves (`list[ModelInfo]`)."""
        request = pb.ListModelsRequest()
        return self._unary(
            self._stub.ListModels,
            request,
            timeout,
            lambda r: [ModelInfo.from_pb(m) for m in r.models],
        )

    def _unary(
        self, method: Any, request: Any, timeout: float | None, value: Callable[[Any], Any]
    ) -> Any:
        raise NotImplementedError

    def _watch(self, timeout: float, service: str) -> Any:
        # Watch, not a loop of Checks: the server pushes each change, and wait_for_ready rides
        # out a server that is not listening yet.
        request = health_pb2.HealthCheckRequest(service=service)
        return self._health.Watch(request, timeout=timeout, wait_for_ready=True)

    def _metadata(
        self, extra: Sequence[tuple[str, str]] = ()
    ) -> tuple[tuple[str, str], ...] | None:
        key = (("authorization", f"Bearer {self._api_key}"),) if self._api_key else ()
        return (*extra, *key) or None
