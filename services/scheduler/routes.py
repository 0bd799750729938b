"""Where each tokenizer's token events go: its shared-memory ring, or a gRPC stream's queue.

Events are batched per step: one `EventBatch` per tokenizer per step, whatever the number of
its requests that advanced.
"""

from __future__ import annotations

import asyncio
import logging

from shm.errors import PeerGone, ShmError
from shm.producer import RingProducer
from tandem.internal.v1 import hotpath_pb2 as hp

log = logging.getLogger(__name__)

EVENT_RING_BYTES = 8 << 20
# A tokenizer whose ring stays full this long is treated as gone.
STALL_S = 5.0


class Route:
    def __init__(self, tokenizer_id: str, shared_memory: bool) -> None:
        self.tokenizer_id = tokenizer_id
        self.ring = RingProducer.create(EVENT_RING_BYTES) if shared_memory else None
        # What the tokenizer's StreamEvents call yields: the batches without shared memory; with
        # it, only the None that ends the call when the route closes.
        self.queue: asyncio.Queue[hp.EventBatch | None] = asyncio.Queue()
        self.closed = False

    def send(self, batch: hp.EventBatch) -> bool:
        """Deliver a batch; False if the tokenizer is gone."""
        if self.closed:
            return False
        if self.ring is None:
            self.queue.put_nowait(batch)
            return True
        try:
            if not self.ring.try_put(batch.SerializeToString()):
                self.ring.put(batch.SerializeToString(), timeout=STALL_S)
        except (PeerGone, TimeoutError, ShmError) as err:
            log.warning("tokenizer %s is gone: %s", self.tokenizer_id, err)
            return False
        return True

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.ring is not None:
            self.ring.close()
        self.queue.put_nowait(None)  # ends the StreamEvents call


class Routes:
    def __init__(self) -> None:
        self.by_tokenizer: dict[str, Route] = {}

    def attach(self, tokenizer_id: str, shared_memory: bool) -> Route:
        """A (re)attaching tokenizer gets a fresh route; an old one of the same id is closed."""
        self.detach(tokenizer_id)
        route = Route(tokenizer_id, shared_memory)
        self.by_tokenizer[tokenizer_id] = route
        return route

    def detach(self, tokenizer_id: str) -> None:
        old = self.by_tokenizer.pop(tokenizer_id, None)
        if old is not None:
            old.close()

    def publish(self, batches: dict[str, hp.EventBatch]) -> list[str]:
        """Send each tokenizer its batch; returns the tokenizers found gone (now detached)."""
        gone = []
        for tokenizer_id, batch in batches.items():
            route = self.by_tokenizer.get(tokenizer_id)
            if route is None or not route.send(batch):
                gone.append(tokenizer_id)
        for tokenizer_id in gone:
            self.detach(tokenizer_id)
        return gone

    def close(self) -> None:
        for tokenizer_id in list(self.by_tokenizer):
            self.detach(tokenizer_id)
