"""The worker's gRPC servicer and its hot-path loop over shared-memory rings.

Steps arrive on a ring from the scheduler and their outcomes leave on another; a dedicated
thread blocks on the step ring, so the event loop stays free for control RPCs. `Step` over gRPC
serves the same records when the scheduler is on another host.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time

from grpc import aio

from engine.engine import Engine
from services.errors import Unavailable
from services.worker.runner import InFlight, StepRunner
from services.worker.telemetry import WorkerTelemetry
from services.worker.threads import ThreadPolicy
from shm.consumer import RingConsumer
from shm.errors import PeerGone, ShmError
from shm.producer import RingProducer
from shm.reader import Reader
from tandem.internal.v1 import hotpath_pb2 as hp
from tandem.internal.v1 import worker_pb2 as wpb
from tandem.internal.v1 import worker_pb2_grpc

log = logging.getLogger(__name__)

RESULT_RING_BYTES = 8 << 20
# How often a thread blocked on the ring (or on room for another step) looks up to see whether
# it should stop.
_IDLE_CHECK_S = 0.5
# Steps launched and not yet sent, at most: the one running and the one being launched. The
# step after them waits, so that every token a placeholder of it may need is on the host.
_IN_FLIGHT = 2


def _send(runner: StepRunner, results: RingProducer, flight: InFlight) -> None:
    outcome = runner.finish(flight)
    outcome.sent_ns = time.monotonic_ns()
    results.put(outcome.SerializeToString())
    runner.telemetry.flush()  # while the scheduler plans the next step


class RingLoop(threading.Thread):
    def __init__(
        self, runner: StepRunner, lock: threading.Lock, step_ring: str, overlap: bool
    ) -> None:
        """overlap: launch each step before the tokens of the one before it are read, which the
        engine then feeds it on the device (Engine.submit), and send each outcome from another
        thread (OutcomeSender) as soon as the device has run its step: the host's work for a
        step, and the scheduler's hop, hide behind the GPU's work on the step before."""
        super().__init__(name="step-ring", daemon=True)
        self.runner = runner
        self.lock = lock
        self.overlap = overlap
        self.steps = RingConsumer.attach(step_ring)
        try:
            self.results = RingProducer.create(RESULT_RING_BYTES)
        except BaseException:
            self.steps.close()
            raise
        self.stopping = threading.Event()

    def run(self) -> None:
        sender = OutcomeSender(self.runner, self.results) if self.overlap else None
        running: InFlight | None = None  # the step launched last
        try:
            if sender is not None:
                sender.start()
            while not self.stopping.is_set():
                try:
                    record = self.steps.get(timeout=_IDLE_CHECK_S)
                except TimeoutError:
                    continue
                received = time.monotonic_ns()
                desc = hp.StepDescriptor.FromString(record)
                if sender is None:
                    with self.lock:
                        flight = self.runner.start(desc)
                    flight.outcome.received_ns = received
                    _send(self.runner, self.results, flight)
                    continue
                if not sender.make_room(self.stopping):
                    break
                with self.lock:
                    flight = self.runner.start(desc, running)
                flight.outcome.received_ns = received
                sender.put(flight)
                running = flight
        except PeerGone:
            log.info("scheduler closed the step ring; the worker waits to be attached again")
        except Exception:
            log.exception("the step ring loop failed")
        finally:
            if sender is not None:
                sender.close()
            self.steps.close()
            self.results.close()

    def stop(self) -> None:
        self.stopping.set()
        self.join()


class OutcomeSender(threading.Thread):
    """Sends the outcomes of launched steps in order, each once the device has run its step,
    while the ring loop launches the next. A step carrying prefill launches eagerly: hundreds of
    kernels, tens of milliseconds of host time. Sent after that launch, the tokens of the step
    before it would wait for all of it (the ITL tail: bench/RESULTS-gpu.md).

    StepRunner.finish runs here without the servicer's lock, beside StepRunner.start on the
    loop's thread: it reads only its own step's outputs (Engine.collect) and writes the tokens
    of sequences that a later step takes from the device, not from the host."""

    def __init__(self, runner: StepRunner, results: RingProducer) -> None:
        super().__init__(name="step-outcomes", daemon=True)
        self.runner = runner
        self.results = results
        self.queue: queue.SimpleQueue[InFlight | None] = queue.SimpleQueue()
        self.room = threading.Semaphore(_IN_FLIGHT)
        self.failed = threading.Event()

    def make_room(self, stopping: threading.Event) -> bool:
        """Wait until another step may be launched; False if it may not (this thread failed,
        or the loop is stopping)."""
        while not self.room.acquire(timeout=_IDLE_CHECK_S):
            if self.failed.is_set() or stopping.is_set():
                return False
        return not self.failed.is_set()

    def put(self, flight: InFlight) -> None:
        self.queue.put(flight)

    def run(self) -> None:
        try:
            while (flight := self.queue.get()) is not None:
                _send(self.runner, self.results, flight)
                self.room.release()
        except PeerGone:
            log.info("scheduler closed the result ring")
        except Exception:
            log.exception("sending a step's outcome failed")
        finally:
            self.failed.set()
            self.room.release()  # wakes the loop, which then sees `failed`

    def close(self) -> None:
        """Send what was launched, then stop; what could not be sent is still waited for."""
        self.queue.put(None)
        self.join()
        while not self.queue.empty():
            flight = self.queue.get()
            if flight is not None and flight.submitted is not None:
                self.runner.engine.collect(flight.submitted)  # nobody will read it


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        engine: Engine,
        model_name: str,
        reader: Reader,
        telemetry: WorkerTelemetry | None = None,
        threads: ThreadPolicy | None = None,
        overlap: bool = False,
    ) -> None:
        """overlap: RingLoop's; worth it on CUDA, where a launch returns before the step has run,
        and not for a tensor-parallel group (Engine.submit)."""
        self.engine = engine
        self.overlap = overlap
        self.model_name = model_name
        self.runner = StepRunner(engine, reader, telemetry, threads)
        self.lock = threading.Lock()
        self.loop: RingLoop | None = None
        self.generation = time.time_ns()

    async def Describe(
        self, request: wpb.DescribeRequest, context: aio.ServicerContext
    ) -> hp.ModelDescription:
        e = self.engine
        return hp.ModelDescription(
            name=self.model_name,
            vocab_size=e.config.vocab_size,
            max_seq_len=e.config.max_seq_len,
            num_kv_blocks=e.num_kv_blocks,
            block_size=e.block_size,
            device=str(e.device),
            dtype=str(e.dtype).removeprefix("torch."),
            weight_format=e.loaded.weight_format,
            worker_pid=os.getpid(),
            worker_generation=self.generation,
        )

    async def Attach(
        self, request: wpb.WorkerAttachRequest, context: aio.ServicerContext
    ) -> wpb.WorkerAttachResponse:
        self.stop_loop()
        with self.lock:
            self.runner.reset()  # a new scheduler: no sequence carries over
        if not request.step_ring:
            log.info("a scheduler attached; steps come as Step calls")
            return wpb.WorkerAttachResponse()
        try:
            self.loop = RingLoop(self.runner, self.lock, request.step_ring, self.overlap)
        except ShmError as err:
            raise Unavailable(f"cannot attach the scheduler's ring: {err}") from err
        self.loop.start()
        log.info("serving steps from %s, results on %s", request.step_ring, self.loop.results.name)
        return wpb.WorkerAttachResponse(result_ring=self.loop.results.name)

    async def Step(
        self, request: hp.StepDescriptor, context: aio.ServicerContext
    ) -> hp.StepOutcome:
        received = time.monotonic_ns()

        def run() -> hp.StepOutcome:
            with self.lock:
                outcome = self.runner.run(request)
                self.runner.telemetry.flush()
                return outcome

        outcome = await asyncio.to_thread(run)
        outcome.received_ns = received
        outcome.sent_ns = time.monotonic_ns()
        return outcome

    def stop_loop(self) -> None:
        if self.loop is not None:
            self.loop.stop()
            self.loop = None
