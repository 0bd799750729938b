"""The tokenizer's link to its scheduler: attach, submit and cancel, and the token events it sends
back, fanned out to the requests of this tokenizer process.

The scheduler sends one `EventBatch` per step on this process's ring (or over a gRPC stream);
each request's `Generate` call awaits its own queue. A request's prompt region in the arena is
freed when the scheduler reports it finished — never earlier, since the worker may still read
it — or when the scheduler is lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from shm.arena import Arena
from shm.consumer import RingConsumer
from shm.errors import PeerGone, ShmError
from shm.handle import Handle
from tandem.internal.v1 import hotpath_pb2 as hp
from tandem.internal.v1 import scheduler_pb2 as spb
from tandem.internal.v1 import scheduler_pb2_grpc

log = logging.getLogger(__name__)


# Attach waits for the scheduler to be up; this only spaces out attempts that failed outright.
_REATTACH_BACKOFF_S = 1.0


@dataclass(eq=False)
class SchedulerLink:
    stub: scheduler_pb2_grpc.SchedulerStub
    address: str
    tokenizer_id: str
    arena: Arena | None
    queues: dict[str, asyncio.Queue[hp.RequestEvents]] = field(default_factory=dict, init=False)
    prompts: dict[str, Handle] = field(default_factory=dict, init=False)
    model: hp.ModelDescription | None = field(default=None, init=False)
    max_queued_requests: int = field(default=0, init=False)
    waiting: int = field(default=0, init=False)  # the scheduler's queue depth, at its last batch
    attached: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _task: asyncio.Task[None] | None = field(default=None, init=False)

    async def start(self) -> None:
        await self._attach()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def open(
        self, request_id: str, prompt: Handle | None, queue: asyncio.Queue[hp.RequestEvents]
    ) -> None:
        """The request's events go to `queue` (shared by the sequences of one call)."""
        self.queues[request_id] = queue
        if prompt is not None:
            self.prompts[request_id] = prompt

    def in_flight(self, request_id: str) -> bool:
        """Listened to, or its prompt still held until the scheduler reports its end."""
        return request_id in self.queues or request_id in self.prompts

    def close(self, request_id: str) -> None:
        """The caller stops listening; the prompt stays until the scheduler finishes the request."""
        self.queues.pop(request_id, None)

    def abandon(self, request_id: str) -> None:
        """The request never reached the scheduler: nothing else will free its prompt."""
        self.close(request_id)
        self._free_prompt(request_id)

    async def _attach(self) -> None:
        self.attached.clear()
        reply = await self.stub.Attach(
            spb.AttachRequest(tokenizer_id=self.tokenizer_id, shared_memory=self.arena is not None),
            wait_for_ready=True,
        )
        self.model = reply.model
        self.max_queued_requests = reply.max_queued_requests
        self._ring = RingConsumer.attach(reply.events_ring) if reply.events_ring else None
        self.attached.set()
        log.info("attached to the scheduler (events on %s)", reply.events_ring or "gRPC")

    async def _run(self) -> None:
        while True:
            why = "its event stream ended"
            try:
                await self._consume()
            except aio.AioRpcError as err:
                why = f"its event stream ended: {err.code().name}"
            except (PeerGone, ShmError, grpc.RpcError) as err:
                why = str(err) or why
            log.error("lost the scheduler (%s); failing in-flight requests", why)
            self.attached.clear()
            error = f"UNAVAILABLE: lost the scheduler ({why}); the request was lost"
            for request_id, queue in list(self.queues.items()):
                queue.put_nowait(
                    hp.RequestEvents(request_id=request_id, finish_reason="error", error=error)
                )
            for request_id in list(self.prompts):
                self._free_prompt(request_id)
            while True:
                try:
                    await self._attach()
                    break
                except (grpc.RpcError, ShmError) as err:
                    log.warning("attaching to the scheduler again failed (%s); retrying", err)
                    await asyncio.sleep(_REATTACH_BACKOFF_S)

    async def _consume(self) -> None:
        """Until the scheduler is lost. The StreamEvents call is held open either way: its end
        is how each side learns at once that the other is gone."""
        stream = self.stub.StreamEvents(spb.StreamEventsRequest(tokenizer_id=self.tokenizer_id))
        ring, self._ring = self._ring, None
        tasks = [asyncio.create_task(self._read_stream(stream))]
        if ring is not None:
            tasks.append(asyncio.create_task(self._read_ring(ring)))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # raises why it ended
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            stream.cancel()
            if ring is not None:
                ring.close()

    async def _read_stream(self, stream: AsyncIterator[hp.EventBatch]) -> None:
        async for batch in stream:
            self.dispatch(batch)
        raise PeerGone("the scheduler ended the event stream")

    async def _read_ring(self, ring: RingConsumer) -> None:
        while True:
            data = await ring.get_async()
            try:
                batch = hp.EventBatch.FromString(data)
            except DecodeError:
                # Only a corrupt ring holds a record that is not an EventBatch.
                raise ShmError(f"ring {ring.name}: a record that does not parse") from None
            self.dispatch(batch)

    def dispatch(self, batch: hp.EventBatch) -> None:
        self.waiting = batch.waiting
        for events in batch.requests:
            queue = self.queues.get(events.request_id)
            if queue is not None:
                queue.put_nowait(events)
            if events.finish_reason:
                self._free_prompt(events.request_id)

    def _free_prompt(self, request_id: str) -> None:
        handle = self.prompts.pop(request_id, None)
        if handle is not None and self.arena is not None:
            try:
                self.arena.free(handle)
            except ShmError as err:
                log.warning("freeing the prompt of %s: %s", request_id, err)
