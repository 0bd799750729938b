"""Session pins: the last turn of each conversation keeps its cached blocks for the next turn.

A pin is one extra reference on each full, cached block of the finished turn, so the blocks
survive eviction by other traffic while the user types. Pins are capped, and released least
recently used first when the cap is reached or memory runs short, before anyone is preempted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from services.scheduler.block_manager import BlockManager


class SessionPins:
    def __init__(self, blocks: BlockManager, max_blocks: int) -> None:
        self.blocks = blocks
        self.max_blocks = max_blocks
        self._pins: OrderedDict[str, list[int]] = OrderedDict()
        self.num_pinned = 0

    def pin(self, session_id: str, block_ids: Sequence[int]) -> None:
        self.release(session_id)
        if not block_ids or len(block_ids) > self.max_blocks:
            return
        self.blocks.acquire(block_ids)
        self._pins[session_id] = list(block_ids)
        self.num_pinned += len(block_ids)
        while self.num_pinned > self.max_blocks:
            self.release_lru()

    def release(self, session_id: str) -> None:
        block_ids = self._pins.pop(session_id, None)
        if block_ids is not None:
            self.num_pinned -= len(block_ids)
            # Back to the prefix cache as most recently used: still reusable until evicted.
            self.blocks.free(block_ids)

    def release_lru(self) -> bool:
        if not self._pins:
            return False
        self.release(next(iter(self._pins)))
        return True

    def items(self) -> list[tuple[str, list[int]]]:
        return list(self._pins.items())
