"""The scheduler's connection to its worker: gRPC for control, shared-memory rings for steps.

With `shared_memory=False` the same records travel as `Worker.Step` calls instead (a worker on
another host). Up to two steps are in flight (async scheduling): the worker runs them in order.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from engine.sampling_params import MAX_GRAMMAR_BYTES
from shm.consumer import RingConsumer
from shm.errors import PeerGone, ShmError
from shm.producer import RingProducer
from tandem.internal.v1 import hotpath_pb2 as hp
from tandem.internal.v1 import worker_pb2 as wpb
from tandem.internal.v1 import worker_pb2_grpc

STEP_RING_BYTES = 16 << 20  # the least: a record may take half of it
# How long one attempt to attach waits for the worker before it is made again, on a new channel.
ATTACH_WAIT_S = 30.0
HOP_SAMPLES = 2048


def step_ring_bytes(max_num_seqs: int) -> int:
    """Room for a step that starts `max_num_seqs` sequences, each with a grammar of the largest
    size, beside 4 MiB of the rest: a record takes at most half of a ring."""
    return max(STEP_RING_BYTES, 2 * (max_num_seqs * MAX_GRAMMAR_BYTES + (4 << 20)))


class WorkerGone(Exception):
    """The worker died or stopped answering; everything in flight is lost."""


class HopTimes:
    """One-way latencies of the last steps' hops (scheduler → worker, worker → scheduler), in µs."""

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=HOP_SAMPLES)

    def add(self, start_ns: int, end_ns: int) -> float | None:
        """Records one hop; its seconds, or None where the two times do not order it."""
        if not start_ns or end_ns < start_ns:
            return None
        self.samples.append((end_ns - start_ns) / 1000)
        return (end_ns - start_ns) * 1e-9

    def percentile(self, q: float) -> float:
        if not self.samples:
            return 0.0
        ordered = sorted(self.samples)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class WorkerLink:
    def __init__(
        self,
        address: str,
        shared_memory: bool = True,
        credentials: grpc.ChannelCredentials | None = None,  # TLS, to a worker on another host
        max_num_seqs: int = 256,
    ) -> None:
        self.address = address
        self.step_ring_bytes = step_ring_bytes(max_num_seqs)
        self.shared_memory = shared_memory
        self.credentials = credentials
        self.channel, self.stub = self._open_channel()
        self.steps: RingProducer | None = None
        self.results: RingConsumer | None = None
        # Over gRPC, steps are calls made one after another (the worker runs plans in order)
        # by a sender task; each outcome (or error) lands in `outcomes`.
        # Each step is tagged with the connection it was sent on: what a lost worker answers
        # (or fails) after the link connected again is dropped.
        self.to_send: asyncio.Queue[tuple[int, hp.StepDescriptor]] = asyncio.Queue()
        self.outcomes: asyncio.Queue[hp.StepOutcome | BaseException] = asyncio.Queue()
        self.connection = 0
        self._sender: asyncio.Task[None] | None = None
        self.to_worker = HopTimes()
        self.to_scheduler = HopTimes()
        self.sent_at: dict[int, int] = {}
        # The last outcome's hops in seconds (to the worker, back), for the metrics.
        self.last_hops: tuple[float | None, float | None] = (None, None)
        self.last_outcome_ns = 0
        self.broken = ""  # why this side gave the rings up (abandon), until the next connect

    def _open_channel(self) -> tuple[aio.Channel, worker_pb2_grpc.WorkerStub]:
        options = [
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
            # A restarted worker is found within a second or two, not gRPC's default minutes.
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        if self.credentials is not None:
            channel = aio.secure_channel(self.address, self.credentials, options)
        else:
            channel = aio.insecure_channel(self.address, options)
        return channel, worker_pb2_grpc.WorkerStub(channel)

    async def reopen(self) -> None:
        """A new channel: after a failed attach, nothing of the old connection is trusted."""
        old = self.channel
        self.channel, self.stub = self._open_channel()
        await old.close()

    async def connect(self) -> hp.ModelDescription:
        """Wait for the worker to be up (gRPC reconnects with backoff), then attach the rings.

        Each call waits at most ATTACH_WAIT_S for the worker (DEADLINE_EXCEEDED then): the caller
        tries again, so a wait that went wrong cannot last forever."""
        self.close_rings()
        self.broken = ""
        self.connection += 1
        for queue in (self.to_send, self.outcomes):
            while not queue.empty():
                queue.get_nowait()
        self.sent_at.clear()
        self.last_outcome_ns = 0
        try:
            description = await self.stub.Describe(
                wpb.DescribeRequest(), wait_for_ready=True, timeout=ATTACH_WAIT_S
            )
            if not self.shared_memory and self._sender is None:
                self._sender = asyncio.create_task(self._send_calls())
            # Attach over either transport: the worker forgets the sequences of a scheduler
            # before.
            self.steps = RingProducer.create(self.step_ring_bytes) if self.shared_memory else None
            request = wpb.WorkerAttachRequest(step_ring=self.steps.name if self.steps else "")
            reply = await self.stub.Attach(request, wait_for_ready=True, timeout=ATTACH_WAIT_S)
            if self.steps is not None:
                self.results = RingConsumer.attach(reply.result_ring)
        except grpc.RpcError as err:
            self.close_rings()
            raise WorkerGone(f"{err.code().name}: {err.details()}") from err
        except ShmError as err:
            self.close_rings()
            raise WorkerGone(f"the rings: {err}") from err
        return description

    def send(self, desc: hp.StepDescriptor) -> None:
        desc.sent_ns = time.monotonic_ns()
        self.sent_at[desc.step_id] = desc.sent_ns
        if self.steps is not None:
            try:
                self.steps.put(desc.SerializeToString(), timeout=5.0)
            except (PeerGone, TimeoutError, ShmError) as err:
                raise WorkerGone(f"cannot send step {desc.step_id}: {err}") from err
        else:
            self.to_send.put_nowait((self.connection, desc))

    async def _send_calls(self) -> None:
        while True:
            connection, desc = await self.to_send.get()
            outcome: hp.StepOutcome | BaseException
            try:
                outcome = await self.stub.Step(desc)
            except grpc.RpcError as err:
                outcome = WorkerGone(f"Worker.Step failed: {err.code().name}")
            if connection == self.connection:
                self.outcomes.put_nowait(outcome)

    async def receive(self) -> hp.StepOutcome:
        """The outcome of the step in flight; raises WorkerGone if the worker is lost."""
        if self.results is not None:
            try:
                data = await self.results.get_async()
                outcome = hp.StepOutcome.FromString(data)
            except (PeerGone, ShmError) as err:
                raise WorkerGone(self.broken or f"the worker's result ring ended: {err}") from err
            except DecodeError as err:
                # Only a corrupt ring holds a record that is not a StepOutcome.
                raise WorkerGone(f"ring {self.results.name}: a record that does not parse") from err
        else:
            item = await self.outcomes.get()
            if isinstance(item, BaseException):
                raise item
            outcome = item
        # With a step queued behind the running one, the worker could not take it before it
        # finished the previous step: the hop is measured from whichever came later.
        # Each step's own send time: with two in flight, the latest send is the next step's.
        sent = self.sent_at.pop(outcome.step_id, 0)
        self.last_hops = (
            self.to_worker.add(max(sent, self.last_outcome_ns), outcome.received_ns),
            self.to_scheduler.add(outcome.sent_ns, time.monotonic_ns()),
        )
        self.last_outcome_ns = outcome.sent_ns
        return outcome

    def abandon(self, why: str) -> None:
        """Give the rings up: the receiver's wait ends with WorkerGone(why)."""
        self.broken = why
        self.close_rings()

    def close_rings(self) -> None:
        for ring in (self.steps, self.results):
            if ring is not None:
                ring.close()
        self.steps = self.results = None

    async def close(self) -> None:
        if self._sender is not None:
            self._sender.cancel()
        self.close_rings()
        await self.channel.close()
