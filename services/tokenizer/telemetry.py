"""The tokenizer's view of one Generate call: its root span, its phases, and its client metrics.

Spans of a request, all in the client's trace when it sent a `traceparent`:

    Generate (SERVER, this process)       GenAI attributes, usage, finish reason, TTFT
    ├── tokenize                          chat template + encode
    ├── Submit (gRPC client → scheduler)  the instrumentation's, context in metadata
    ├── queue / prefill / decode          the scheduler's (parented by SubmitRequest.traceparent)
    └── stream                            token events → detokenized text → the client

Two spans and a handful of metric updates per request; per streamed message only a histogram
observation, never a span.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.errors import status_of
from services.telemetry.propagation import context_from_metadata, traceparent_of
from services.telemetry.tracing import Tracing
from services.tokenizer.metrics import TokenizerMetrics

_GRPC_CALL = {"rpc.system": "grpc", "rpc.service": "tandem.v1.Generation", "rpc.method": "Generate"}


@dataclass(frozen=True)
class TokenizerTelemetry:
    """Per process: makes a GenerateCall for each request."""

    tracing: Tracing
    metrics: TokenizerMetrics
    model_name: str

    def begin(
        self, metadata: Iterable[tuple[str, str | bytes]] | None, http_route: str = ""
    ) -> GenerateCall:
        """`metadata`: the gRPC call's, or an HTTP request's headers (with its `http_route`);
        either may carry the caller's `traceparent`."""
        return GenerateCall(self, context_from_metadata(metadata), http_route)


class GenerateCall:
    def __init__(
        self, owner: TokenizerTelemetry, parent: Context | None, http_route: str = ""
    ) -> None:
        self.tracer = owner.tracing.tracer
        self.metrics = owner.metrics
        self.model_name = owner.model_name
        self.parent = parent
        self._t0 = self._last_token = time.perf_counter()
        self._ttft = 0.0
        self._output_tokens = 0
        self._ended = False
        self.recording = owner.tracing.enabled
        self.span: trace.Span = trace.INVALID_SPAN
        self.stream_span: trace.Span = trace.INVALID_SPAN
        if self.recording:
            http = {"http.request.method": "POST", "http.route": http_route}
            api = http if http_route else _GRPC_CALL
            self.span = self.tracer.start_span(
                "Generate",
                context=parent,
                kind=SpanKind.SERVER,
                attributes={**api, "gen_ai.request.model": owner.model_name},
            )
            self.recording = self.span.is_recording()
        self.metrics.running.inc()

    @property
    def trace_id(self) -> str:
        """The trace id (32 hex digits) for the first response; the caller's if not tracing."""
        ctx = self.span.get_span_context()
        if not ctx.is_valid and self.parent is not None:
            ctx = trace.get_current_span(self.parent).get_span_context()
        return f"{ctx.trace_id:032x}" if ctx.is_valid else ""

    @property
    def traceparent(self) -> str:
        """What SubmitRequest.traceparent carries: the scheduler's request spans hang under it."""
        return traceparent_of(self.span.get_span_context())

    def on_request(
        self,
        *,
        request_id: str,
        chat: bool,
        temperature: float,
        top_p: float,
        top_k: int,
        seed: int | None,
        priority: int,
        session_id: str | None,
        output_format: str | None = None,
    ) -> None:
        if not self.recording:
            return
        attributes: dict[str, str | int | float] = {
            "gen_ai.operation.name": "chat" if chat else "text_completion",
            "gen_ai.request.temperature": temperature,
            "gen_ai.request.top_p": top_p,
            "gen_ai.request.top_k": top_k,
            "gen_ai.response.id": request_id,
            "tandem.request_id": request_id,
            "tandem.priority": priority,
        }
        if seed is not None:
            attributes["gen_ai.request.seed"] = seed
        if session_id:
            attributes["tandem.session_id"] = session_id
        if output_format:
            attributes["tandem.output_format"] = output_format
            attributes["gen_ai.output.type"] = (
                "json" if output_format.startswith("json") else "text"
            )
        self.span.set_attributes(attributes)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A child span of Generate around a step of this process's own work (e.g. tokenize)."""
        if not self.recording:
            yield
            return
        span = self.tracer.start_span(name, context=trace.set_span_in_context(self.span))
        try:
            yield
        except BaseException as err:
            _fail(span, err)
            raise
        finally:
            span.end()

    def active(self) -> contextlib.AbstractContextManager[object]:
        """Generate as the current span, for the gRPC calls made on its behalf (Submit, Cancel):
        the client interceptor puts it in their metadata. Hold it only around one await."""
        if not self.recording:
            return contextlib.nullcontext()
        return trace.use_span(self.span, end_on_exit=False)

    def on_submitted(self, prompt_tokens: int, max_tokens: int) -> None:
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.request_prompt_tokens.observe(prompt_tokens)
        if self.recording:
            self.span.set_attributes(
                {
                    "gen_ai.request.max_tokens": max_tokens,
                    "gen_ai.usage.input_tokens": prompt_tokens,
                }
            )
            self.stream_span = self.tracer.start_span(
                "stream", context=trace.set_span_in_context(self.span)
            )

    def on_tokens(self, n: int, queue_s: float) -> None:
        """A message with `n` new tokens is about to be sent; `queue_s` if the scheduler said."""
        now = time.perf_counter()
        if queue_s and self.recording:
            self.span.set_attribute("tandem.queue_s", queue_s)
        if not n:
            return
        if self._output_tokens == 0:
            self._ttft = now - self._t0
            self.metrics.ttft.observe(self._ttft)
            if self.recording:
                self.span.set_attribute("tandem.ttft_s", self._ttft)
                self.span.add_event("first_token")
        else:
            self.metrics.itl.observe(now - self._last_token)
        self._last_token = now
        self._output_tokens += n
        self.metrics.generation_tokens.inc(n)

    def finish(self, reason: str, output_tokens: int, cached_prompt_tokens: int) -> None:
        """The last message is about to be sent."""
        e2e = time.perf_counter() - self._t0
        m = self.metrics
        m.e2e.observe(e2e)
        m.request_generation_tokens.observe(output_tokens)
        if output_tokens > 1:
            m.tpot.observe((e2e - self._ttft) / (output_tokens - 1))
        m.outcome(reason)
        if self.recording:
            self.span.set_attributes(
                {
                    "gen_ai.usage.output_tokens": output_tokens,
                    "gen_ai.response.finish_reasons": (reason,),
                    "gen_ai.response.model": self.model_name,
                    "tandem.cached_prompt_tokens": cached_prompt_tokens,
                    "tandem.e2e_s": e2e,
                }
            )
        self.end()

    def fail(self, err: BaseException) -> None:
        """The call ends with an error, or the client went away (GeneratorExit, cancellation)."""
        if self._ended:
            return
        if isinstance(err, GeneratorExit | asyncio.CancelledError):
            reason = "cancelled"
        else:
            status = status_of(err)
            code = status[0] if status is not None else grpc.StatusCode.INTERNAL
            reason = code.name.lower()
        self.metrics.outcome(reason)
        if self.recording:
            self.span.set_attribute("gen_ai.response.finish_reasons", (reason,))
            if reason == "cancelled":
                self.span.set_attribute("error.type", "cancelled")
            else:
                _fail(self.span, err)
                self.stream_span.set_status(Status(StatusCode.ERROR, reason))
        self.end()

    def __enter__(self) -> GenerateCall:
        return self

    def __exit__(self, kind: object, err: BaseException | None, traceback: object) -> None:
        if err is not None:
            self.fail(err)
        self.end()

    def end(self) -> None:
        """Whatever happened, close the spans (a no-op after finish or fail)."""
        if self._ended:
            return
        self._ended = True
        self.metrics.running.dec()
        self.stream_span.end()
        self.span.end()


def _fail(span: trace.Span, err: BaseException) -> None:
    span.record_exception(err)
    span.set_status(Status(StatusCode.ERROR, f"{type(err).__name__}: {err}"))
