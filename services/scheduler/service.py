"""The scheduler's gRPC servicer: thin — validate, convert, hand to the loop."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc
from grpc import aio

from services.errors import InvalidArgument, ServiceError, Unavailable
from services.scheduler.loop import RequestRecord, StepLoop
from services.scheduler.request import Request
from services.telemetry.propagation import current_traceparent
from shm.errors import ShmError
from shm.handle import Handle
from shm.reader import Reader
from tandem.internal.v1 import hotpath_pb2 as hp
from tandem.internal.v1 import scheduler_pb2 as spb
from tandem.internal.v1 import scheduler_pb2_grpc


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, loop: StepLoop, reader: Reader, max_queued_requests: int) -> None:
        self.loop = loop
        self.reader = reader
        self.max_queued_requests = max_queued_requests

    async def Attach(
        self, request: spb.AttachRequest, context: aio.ServicerContext
    ) -> spb.AttachResponse:
        if not request.tokenizer_id:
            raise InvalidArgument("tokenizer_id", "is required")
        await self.loop.ready.wait()
        # A tokenizer that attaches again was restarted: what it had in flight is gone.
        self.loop.cancel_tokenizer(request.tokenizer_id)
        route = self.loop.routes.attach(request.tokenizer_id, request.shared_memory)
        return spb.AttachResponse(
            events_ring=route.ring.name if route.ring is not None else "",
            model=self.loop.model,
            max_queued_requests=self.max_queued_requests,
        )

    async def Submit(
        self, request: spb.SubmitRequest, context: aio.ServicerContext
    ) -> spb.SubmitResponse:
        if request.tokenizer_id not in self.loop.routes.by_tokenizer:
            raise ServiceError(
                f"tokenizer {request.tokenizer_id!r} is not attached",
                code=grpc.StatusCode.FAILED_PRECONDITION,
            )
        if not self.loop.ready.is_set():
            raise Unavailable(self.loop.worker_down())
        if request.HasField("prompt_handle"):
            try:
                prompt = self.reader.view(Handle.from_bytes(request.prompt_handle)).tolist()
            except ShmError as err:
                raise InvalidArgument("prompt_handle", str(err)) from err
        else:
            prompt = list(request.prompt_ids.ids)
        if len(prompt) != request.prompt_len:
            raise InvalidArgument(
                "prompt_len", f"is {request.prompt_len}, the prompt holds {len(prompt)}"
            )
        deadline = time.monotonic() + request.timeout_s if request.timeout_s > 0 else None
        seq_id = self.loop.next_seq_id()
        record = RequestRecord(
            seq_id=seq_id,
            prompt_len=request.prompt_len,
            prompt_handle=request.prompt_handle,
            prompt_ids=[] if request.prompt_handle else prompt,
            # The tokenizer's request span; else whatever context the call's metadata brought.
            traceparent=request.traceparent or current_traceparent(),
            request_id=request.request_id,
            tokenizer_id=request.tokenizer_id,
        )
        self.loop.submit(
            record,
            Request(
                seq_id=seq_id,
                prompt_token_ids=prompt,
                max_tokens=request.max_tokens,
                stop_token_ids=frozenset(request.stop_token_ids),
                priority=request.priority,
                deadline=deadline,
                session_id=request.session_id or None,
                sampling=request.sampling,
                reuse_prefix=not request.sampling.HasField("prompt_logprobs"),
            ),
        )
        return spb.SubmitResponse()

    async def Cancel(
        self, request: spb.CancelRequest, context: aio.ServicerContext
    ) -> spb.CancelResponse:
        return spb.CancelResponse(found=self.loop.cancel(request.request_id))

    async def Stats(
        self, request: spb.StatsRequest, context: aio.ServicerContext
    ) -> spb.StatsResponse:
        reply = spb.StatsResponse(
            worker_ready=self.loop.ready.is_set(),
            worker_restarts=self.loop.worker_restarts,
            hop_p50_us=self.loop.link.to_worker.percentile(0.5),
            hop_p99_us=self.loop.link.to_worker.percentile(0.99),
        )
        if self.loop.core is not None:
            s = self.loop.core.stats()
            reply.running, reply.waiting = s.num_running, s.num_waiting
            reply.kv_blocks_total, reply.kv_blocks_used = s.kv_blocks_total, s.kv_blocks_used
            reply.kv_blocks_cached = s.kv_blocks_cached
            reply.kv_blocks_session_pinned = s.kv_blocks_session_pinned
            reply.prefix_cache_queries = s.prefix_cache_queries
            reply.prefix_cache_hits = s.prefix_cache_hits
            reply.preemptions, reply.steps = s.num_preemptions, s.num_steps
            reply.finished.update(s.num_finished)
        return reply

    async def StreamEvents(
        self, request: spb.StreamEventsRequest, context: aio.ServicerContext
    ) -> AsyncIterator[hp.EventBatch]:
        tokenizer_id = request.tokenizer_id
        route = self.loop.routes.by_tokenizer.get(tokenizer_id)
        if route is None:
            raise InvalidArgument("tokenizer_id", f"{tokenizer_id!r} must attach first")
        try:
            while (batch := await route.queue.get()) is not None:
                yield batch
        finally:
            # The call ended without the route closing first: the tokenizer is gone (killed,
            # or cut off), and so is every stream of its requests.
            if self.loop.routes.by_tokenizer.get(tokenizer_id) is route:
                self.loop.routes.detach(tokenizer_id)
                self.loop.cancel_tokenizer(tokenizer_id)
