"""A closed-loop load of N streams that runs beside a fault: each slot sends one request after
another on its own channel (so that tokenizers sharing the public port each get some), and
backs off briefly after an error, as a sane client would."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

from bench.faults import calls
from bench.faults.outcome import Outcome, Tally
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc

RETRY_AFTER_ERROR_S = 0.5


class Load:
    def __init__(
        self,
        address: str,
        streams: int,
        make: Callable[[random.Random], pb.GenerateRequest],
        seed: int,
        tally: Tally,
    ) -> None:
        self.address = address
        self.make = make
        self.tally = tally
        self.rngs = [random.Random(seed * 1000 + i) for i in range(streams)]
        # Set while slot i has a stream that has produced a token.
        self.streaming = [asyncio.Event() for _ in range(streams)]
        self.stopping = False
        self.tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._slot(i)) for i in range(len(self.rngs))]

    async def steady(self, bound_s: float) -> bool:
        """True once every slot is streaming (within the bound)."""
        try:
            async with asyncio.timeout(bound_s):
                for event in self.streaming:
                    await event.wait()
            return True
        except TimeoutError:
            return False

    async def stop(self) -> None:
        """Let every slot finish the request it is on (each wait is bounded), then stop."""
        self.stopping = True
        await asyncio.gather(*self.tasks)

    async def _slot(self, i: int) -> None:
        rng, streaming = self.rngs[i], self.streaming[i]
        async with calls.channel(self.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            while not self.stopping:
                streaming.clear()
                outcome: Outcome = await calls.generate(
                    stub, self.make(rng), on_reply=lambda n: streaming.set() if n else None
                )
                streaming.clear()
                self.tally.add(outcome)
                if outcome.kind != "ok":
                    await asyncio.sleep(RETRY_AFTER_ERROR_S)
