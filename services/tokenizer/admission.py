"""One admission path for a generation, whichever API it came by (gRPC, HTTP): check the
queue, tokenize, put the prompt in shared memory, submit it to the scheduler, turn its token
events into text, and cancel the work when the caller goes away or a stop string ends it."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Callable, Coroutine
from functools import partial
from typing import Any, TypeVar

import numpy as np
from grpc import aio

from engine.errors import ContextLengthExceeded, InvalidRequest
from engine.sampling_params import MAX_BAD_WORDS_IDS, SamplingParams
from engine.tokenizer import Tokenizer
from services.errors import ResourceExhausted, ServiceError, Unavailable
from services.protocol import sampling_to_pb
from services.tokenizer.grammars import Grammars
from services.tokenizer.request import (
    DEFAULT_MAX_TOKENS,
    TRUNCATE_HINT,
    ChatRendering,
    GenerateSpec,
    parse_generate,
)
from services.tokenizer.scheduler_link import SchedulerLink
from services.tokenizer.stream import TextStream
from services.tokenizer.telemetry import GenerateCall, TokenizerTelemetry
from shm.arena import Arena
from shm.errors import ArenaFull
from tandem.internal.v1 import hotpath_pb2 as hp
from tandem.internal.v1 import scheduler_pb2 as spb
from tandem.v1 import generation_pb2 as pb

log = logging.getLogger(__name__)

# Texts longer than this many characters (or ids, to detokenize) are done off the event loop.
_INLINE_TOKENIZE_CHARS = 4096
# A call ended this close to its deadline ended by it (the client's clock runs out first): the
# scheduler drops the request at that deadline by itself, so no Cancel is sent.
_DEADLINE_SLACK_S = 0.1


@dataclasses.dataclass(eq=False)
class Admission:
    tokenizer: Tokenizer
    model_name: str
    link: SchedulerLink
    arena: Arena | None
    telemetry: TokenizerTelemetry
    _background: set[asyncio.Task[None]] = dataclasses.field(default_factory=set, init=False)
    _grammars: Grammars = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self._grammars = Grammars(self.tokenizer)

    @property
    def max_seq_len(self) -> int:
        model = self.link.model
        return model.max_seq_len if model is not None else 0

    def parse(self, request: pb.GenerateRequest) -> GenerateSpec:
        """`request` checked; only once attached, as the scheduler's model sets the context."""
        if not self.link.attached.is_set():
            raise Unavailable(f"not attached to a scheduler: waiting for it at {self.link.address}")
        vocab_size = self.tokenizer.vocab_size
        return parse_generate(request, self.model_name, vocab_size, self.max_seq_len)

    async def generate(
        self, spec: GenerateSpec, call: GenerateCall, deadline: float | None
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """The request's messages: the first (ids, trace), the text deltas, the last (finish
        reason, usage) of each of its n sequences. `deadline`: the client's, on the monotonic
        clock. Close it to cancel."""
        call.on_request(
            request_id=spec.request_id,
            chat=spec.messages is not None,
            temperature=spec.sampling.temperature,
            top_p=spec.sampling.top_p,
            top_k=spec.sampling.top_k,
            seed=spec.sampling.seed,
            priority=spec.priority,
            session_id=spec.session_id,
            output_format=spec.output_format.kind if spec.output_format else None,
        )
        limit = self.link.max_queued_requests
        if limit and self.link.waiting >= limit:
            raise ResourceExhausted(f"{self.link.waiting} requests are already waiting")
        sampling = spec.sampling
        if spec.output_format is not None:
            with call.phase("grammar"):
                grammar = await self._grammars.compile(spec.output_format)
            sampling = dataclasses.replace(sampling, grammar=grammar)
        with call.phase("tokenize"):
            prompt_ids = await self._tokenize(spec)
        rid = spec.request_id
        ids = [rid] if spec.n == 1 else [f"{rid}/{i}" for i in range(spec.n)]  # the scheduler's
        # Events and prompts are filed under these ids: a second request would take the first's.
        # Checked after tokenizing (which may await), with nothing awaited before they are open.
        if any(self.link.in_flight(i) for i in ids):
            raise InvalidRequest("request_id", f"{spec.request_id!r} is already in flight")
        max_tokens = self._max_tokens(spec, len(prompt_ids))
        stop_ids = spec.stop_token_ids | (
            frozenset() if spec.ignore_eos else self.tokenizer.eos_token_ids
        )
        if spec.bad_words:
            sampling = dataclasses.replace(sampling, bad_words_ids=self._bad_words_ids(spec))
        if sampling.min_tokens:
            allowed = set(sampling.allowed_token_ids)
            if allowed and allowed <= stop_ids:  # min_tokens would leave nothing to take
                raise InvalidRequest(
                    "sampling.allowed_token_ids",
                    "are all ids that end the sequence, which min_tokens holds back",
                )
            sampling = dataclasses.replace(sampling, stop_token_ids=tuple(sorted(stop_ids)))
        queue: asyncio.Queue[hp.RequestEvents] = asyncio.Queue()
        # The first sequence scores the prompt for all (the others then share its blocks).
        scored = prompt_ids if sampling.prompt_logprobs is not None else None
        streams = [
            TextStream(self.tokenizer, spec, stop_ids, scored if i == 0 else None)
            for i in range(len(ids))
        ]
        submitted: list[str] = []
        done: set[int] = set()
        template = spb.SubmitRequest(
            tokenizer_id=self.link.tokenizer_id,
            prompt_len=len(prompt_ids),
            max_tokens=max_tokens,
            stop_token_ids=sorted(stop_ids),
            priority=spec.priority,
            session_id=spec.session_id or "",
            traceparent=call.traceparent,
        )
        if self.arena is None:
            template.prompt_ids.ids.extend(prompt_ids)

        async def submit(i: int) -> None:
            remaining = 0.0 if deadline is None else max(deadline - time.monotonic(), 1e-3)
            request = spb.SubmitRequest(
                request_id=ids[i], sampling=sampling_to_pb(_nth(sampling, i)), timeout_s=remaining
            )
            request.MergeFrom(template)
            handle = None
            if self.arena is not None:
                try:
                    handle = self.arena.put(np.asarray(prompt_ids, dtype=np.int32))
                except ArenaFull as err:
                    raise ResourceExhausted(f"the prompt arena is full: {err}") from err
                request.prompt_handle = handle.to_bytes()
            self.link.open(ids[i], handle, queue)
            sent = asyncio.ensure_future(self._submit(request, call))
            try:
                # Shielded: a caller gone while the Submit is on its way does not stop it (the
                # scheduler may have the request already, and the worker its prompt).
                await asyncio.shield(sent)
            except BaseException:
                if not sent.done():
                    self._in_background(self._settle(sent, ids[i]), call)
                elif sent.cancelled() or sent.exception() is not None:
                    self.link.abandon(ids[i])
                else:
                    submitted.append(ids[i])  # it got there: cancelled below
                raise
            submitted.append(ids[i])

        try:
            await submit(0)
            call.on_submitted(len(prompt_ids), max_tokens)
            # The others follow at the first's first event, when the step that prefills it is
            # planned. The scheduler keeps at most two steps in flight, that one and the next,
            # so the first step that can take them is planned after the prefill's result, with
            # its full blocks in the prefix cache: they compute only the last, partial one. A
            # prompt shorter than a block shares nothing, so they go at once.
            block = self.link.model.block_size if self.link.model is not None else 0
            later = list(range(1, len(ids)))
            if not block or (len(prompt_ids) - 1) // block == 0:
                while later:
                    await submit(later.pop(0))
            yield pb.GenerateResponse(
                request_id=spec.request_id, trace_id=call.trace_id, prompt_token_ids=prompt_ids
            )
            index_of = {rid: i for i, rid in enumerate(ids)}
            while len(done) < len(ids):
                events = await queue.get()
                i = index_of[events.request_id]
                if i in done:
                    continue  # queued before its stop string ended it
                reply = streams[i].on_events(events)
                reply.index = i
                call.on_tokens(len(reply.token_ids), events.queue_s)
                if reply.finish_reason:
                    reply.usage.prompt_tokens = len(prompt_ids)
                    done.add(i)
                    self.link.close(ids[i])
                    if streams[i].stops.stopped:  # the scheduler is still generating it
                        self._in_background(self._cancel(ids[i]), call)
                while later:
                    await submit(later.pop(0))
                if len(done) == len(ids):
                    tokens = sum(stream.num_tokens for stream in streams)
                    call.finish(reply.finish_reason, tokens, streams[0].cached_prompt_tokens)
                yield reply
        finally:
            expired = deadline is not None and deadline - time.monotonic() < _DEADLINE_SLACK_S
            for i, request_id in enumerate(ids):
                if request_id not in submitted or i in done:
                    continue
                self.link.close(request_id)
                if not expired:
                    # The client went away, or another sequence failed: stop the work too. (At
                    # the client's deadline the scheduler drops the request by itself.)
                    self._in_background(self._cancel(request_id), call)

    def _in_background(self, work: Coroutine[Any, Any, None], call: GenerateCall) -> None:
        with call.active():  # the task copies the context: Cancel joins the trace
            task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _settle(self, sent: asyncio.Future[None], request_id: str) -> None:
        """A Submit whose caller went away: once the scheduler has answered, cancel the request
        there (its end, reported by the scheduler, frees the prompt), or free the prompt here if
        it never got there."""
        try:
            await sent
        except Exception:
            self.link.abandon(request_id)
            return
        self.link.close(request_id)
        await self._cancel(request_id)

    async def encode(
        self,
        text: str,
        messages: list[dict[str, Any]] | None,
        *,
        allow_special: bool,
        field: str = "text",
        tools: list[Any] | None = None,
        rendering: ChatRendering | None = None,
    ) -> list[int]:
        """The ids of `messages` (and `tools`) through the chat template, or else of `text`."""
        tok = self.tokenizer
        if messages is not None:
            size = sum(len(m["content"]) for m in messages)
            r = rendering or ChatRendering()
            encode_chat = partial(
                tok.encode_chat,
                messages,
                r.add_generation_prompt,
                tools=tools,
                continue_final_message=r.continue_final_message,
                variables=r.variables,
            )
            return await off_the_loop_if_long(size, encode_chat)
        encode = partial(tok.encode_prompt, text, allow_special=allow_special, field=field)
        return await off_the_loop_if_long(len(text), encode)

    async def _tokenize(self, spec: GenerateSpec) -> list[int]:
        if spec.prompt_ids is not None:
            return spec.prompt_ids
        allow_special = not spec.split_special_tokens
        ids = await self.encode(
            spec.text or "",
            spec.messages,
            allow_special=allow_special,
            field="prompt.text",
            tools=spec.tools,
            rendering=spec.rendering,
        )
        if not ids:
            raise InvalidRequest("prompt", "tokenizes to nothing")
        if (keep := spec.keep_prompt_tokens) is not None and len(ids) > keep:
            # The beginning-of-sequence token stays first, as a tokenizer that truncates keeps it.
            bos = self.tokenizer.bos_token_id
            ids = [bos, *ids[len(ids) - keep + 1 :]] if ids[0] == bos and keep > 1 else ids[-keep:]
        if len(ids) >= self.max_seq_len:
            raise ContextLengthExceeded(
                "prompt",
                f"{len(ids)} tokens do not fit the model's context of {self.max_seq_len}"
                f"{TRUNCATE_HINT}",
            )
        return ids

    def _bad_words_ids(self, spec: GenerateSpec) -> tuple[tuple[int, ...], ...]:
        """Each bad word's tokens at the start of a text and after a space (vLLM's two forms)."""
        forms = {form for word in spec.bad_words for form in (word.lstrip(), f" {word.lstrip()}")}
        encode = partial(self.tokenizer.encode, allow_special=False, field="bad_words")
        encoded = {tuple(encode(form)) for form in forms}
        words = tuple(sorted(ids for ids in encoded if ids))
        if sum(map(len, words)) > MAX_BAD_WORDS_IDS:
            raise InvalidRequest("bad_words", f"more than {MAX_BAD_WORDS_IDS} tokens in all")
        return words

    def _max_tokens(self, spec: GenerateSpec, prompt_len: int) -> int:
        room = self.max_seq_len - prompt_len
        if spec.sampling.min_tokens > room:
            raise ContextLengthExceeded(
                "min_tokens",
                f"{prompt_len} prompt tokens + {spec.sampling.min_tokens} exceed the model's "
                f"context of {self.max_seq_len}",
            )
        if spec.max_tokens is None:
            return min(max(DEFAULT_MAX_TOKENS, spec.sampling.min_tokens), room)
        if spec.max_tokens > room:
            raise ContextLengthExceeded(
                "max_tokens",
                f"{prompt_len} prompt tokens + {spec.max_tokens} exceed the model's context of "
                f"{self.max_seq_len}; ask for at most {room}",
            )
        return spec.max_tokens

    async def _submit(self, request: spb.SubmitRequest, call: GenerateCall) -> None:
        try:
            with call.active():  # the client interceptor puts the trace in the call's metadata
                await self.link.stub.Submit(request)
        except aio.AioRpcError as err:
            raise ServiceError(err.details() or err.code().name, code=err.code()) from None

    async def _cancel(self, request_id: str) -> None:
        try:
            await self.link.stub.Cancel(spb.CancelRequest(request_id=request_id))
        except aio.AioRpcError as err:
            log.warning("cancelling %s: %s", request_id, err.code().name)


_T = TypeVar("_T")


async def off_the_loop_if_long(size: int, work: Callable[[], _T]) -> _T:
    """`work`, on a thread when `size` (characters, or ids) is large: a long text would hold the
    event loop, and every stream and call of this process, meanwhile."""
    return await asyncio.to_thread(work) if size > _INLINE_TOKENIZE_CHARS else work()


def _nth(sampling: SamplingParams, i: int) -> SamplingParams:
    """Sequence i's sampling: its own seed when seeded, so n seeded sequences differ."""
    if i == 0:
        return sampling
    seed = None if sampling.seed is None else (sampling.seed + i) % 2**63
    # The first sequence scores the prompt (prompt_logprobs): the others need not.
    return dataclasses.replace(sampling, seed=seed, prompt_logprobs=None)
