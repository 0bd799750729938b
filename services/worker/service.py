"""The worker's gRPC servicer and its hot-path loop over shared-memory rings.

Steps arrive on a ring from the scheduler and their outcomes leave on another; a dedicated
thread blocks on the step ring, so the event loop stays free for control RPCs. `Step` over gRPC
serves the same records when the scheduler is on another host.
"""

from __future__ import annotations

import asyncio
import logging
import os
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
# How often the ring thread looks up from an idle ring to see whether it should stop.
_IDLE_CHECK_S = 0.5
# How often, with a step running and no next one yet, it looks whether the step is done.
_POLL_S = 100e-6


class RingLoop(threading.Thread):
    def __init__(
        self, runner: StepRunner, lock: threading.Lock, step_ring: str, overlap: bool
    ) -> None:
        """overlap: launch each decode-only step before reading the tokens of the one before
        it, which the engine then feeds it on the device (Engine.submit); the host's work for a
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
        running: InFlight | None = None  # launched, its outcome not sent yet
        try:
            while not self.stopping.is_set():
                record = self._next(running)
                if record is None:
                    if running is not None:  # it is done and no step came to follow it
                        self._send(running)
                        running = None
                    continue
                received = time.monotonic_ns()
                desc = hp.StepDescriptor.FromString(record)
                if running is not None and desc.num_prefill_tokens:
                    flight = self._start_after_sending(desc, running)
                else:
                    with self.lock:
                        flight = self.runner.start(desc, running if self.overlap else None)
                    if running is not None:
                        self._send(running)
                flight.outcome.received_ns = received
                running = flight
                if not self.overlap:
                    self._send(running)
                    running = None
        except PeerGone:
            log.info("scheduler closed the step ring; the worker waits to be attached again")
        except Exception:
            log.exception("the step ring loop failed")
        finally:
            if running is not None and running.submitted is not None:
                with self.lock:
                    self.runner.engine.collect(running.submitted)  # nobody will read it
            self.steps.close()
            self.results.close()

    def _next(self, running: InFlight | None) -> bytes | None:
        """The next step's record; None after a pause with none, or (with a step running)
        as soon as that step is done."""
        while True:
            try:
                return self.steps.get(timeout=_IDLE_CHECK_S if running is None else _POLL_S)
            except TimeoutError:
                if running is None or running.done():
                    return None

    def _start_after_sending(self, desc: hp.StepDescriptor, running: InFlight) -> InFlight:
        """A step with prefill launches eagerly, hundreds of kernels, and its launch can block
        on the device part-way (a full launch queue): the tokens of the step before would wait
        for all of it. So its host work (sequences admitted, inputs built and uploaded) runs
        while the step before still runs, and that step's outcome is sent just before this
        one's kernels are queued."""
        sent: list[BaseException | None] = []

        def send_running() -> None:
            try:
                self._put(self.runner.finish(running))  # the lock is start's
            except BaseException as err:  # raised again below, not through the engine
                sent.append(err)
            else:
                sent.append(None)

        with self.lock:
            flight = self.runner.start(desc, running, send_running)
        if not sent:  # the step failed, or had nothing to run, before its launch
            with self.lock:
                outcome = self.runner.finish(running)
            self._put(outcome)
        elif sent[0] is not None:
            raise sent[0]
        self.runner.telemetry.flush()
        return flight

    def _send(self, flight: InFlight) -> None:
        with self.lock:
            outcome = self.runner.finish(flight)
        self._put(outcome)
        self.runner.telemetry.flush()  # while the scheduler plans the next step

    def _put(self, outcome: hp.StepOutcome) -> None:
        outcome.sent_ns = time.monotonic_ns()
        self.results.put(outcome.SerializeToString())

    def stop(self) -> None:
        self.stopping.set()
        self.join()


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
