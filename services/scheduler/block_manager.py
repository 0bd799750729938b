"""The paged KV accounts: which physical blocks are free, shared, or cached for reuse.

The worker owns the memory; this class only decides which block ids each sequence holds.
A block is in exactly one of three conditions:

    in use    ref_count > 0          held by running sequences and/or session pins
    cached    ref_count == 0, hash   free, but its contents still name a prefix: reusable
    empty     ref_count == 0, none   free, contents meaningless

`_free` holds every block with ref_count 0 in eviction order: empty blocks at the front (used
first), cached blocks behind them from least to most recently freed. Allocation pops the front;
taking a cached block out of the cache forgets its hash (LRU eviction). Every operation is O(1)
per block touched: nothing here scans the pool.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    # Chained: a block's hash covers every token before it, so equal hashes mean equal prefixes.
    # A cryptographic digest, because a collision would hand one client another's KV.
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.ref_counts: list[int] = []
        self.block_hashes: list[bytes | None] = []
        self.cached: dict[bytes, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict()
        self.num_evictions = 0
        self.reset()

    @property
    def num_free(self) -> int:
        # Cached blocks count as free: they are given up the moment memory is needed.
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def lookup(self, block_hashes: Sequence[bytes], max_blocks: int) -> list[int]:
        """The longest run of leading blocks already cached, at most `max_blocks` of them."""
        hits: list[int] = []
        cached = self.cached
        for block_hash in block_hashes[:max_blocks]:
            block_id = cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def num_unreferenced(self, block_ids: Sequence[int]) -> int:
        """How many of these (cached) blocks sit in the free pool: acquiring them takes from it."""
        refs = self.ref_counts
        return sum(1 for b in block_ids if refs[b] == 0)

    def acquire(self, block_ids: Sequence[int]) -> None:
        refs = self.ref_counts
        for block_id in block_ids:
            if refs[block_id] == 0:
                del self._free[block_id]
            refs[block_id] += 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"allocate({n}) with only {len(self._free)} free blocks")
        return [self._take() for _ in range(n)]

    def allocate_one(self) -> int:
        """allocate(1)[0], without the list: a decode crossing into a new block."""
        if not self._free:
            raise RuntimeError("allocate_one() with no free block")
        return self._take()

    def _take(self) -> int:
        """The least recently freed block, referenced once; a cached one gives up its prefix."""
        block_id, _ = self._free.popitem(last=False)
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:  # evict
            self.block_hashes[block_id] = None
            del self.cached[block_hash]
            self.num_evictions += 1
        self.ref_counts[block_id] = 1
        return block_id

    def free(self, block_ids: Sequence[int]) -> None:
        refs, hashes, free = self.ref_counts, self.block_hashes, self._free
        # Tail first: a sequence's last blocks are the least likely to be shared again, so they
        # should be evicted before its first ones.
        for block_id in reversed(block_ids):
            refs[block_id] -= 1
            if refs[block_id] == 0:
                free[block_id] = None
                if hashes[block_id] is None:
                    free.move_to_end(block_id, last=False)

    def register(self, block_id: int, block_hash: bytes) -> None:
        """Offer a computed full block to the prefix cache (the first holder of a prefix wins)."""
        if not self.enable_caching or self.block_hashes[block_id] is not None:
            return
        if block_hash in self.cached:
            # Another block already holds this prefix (two requests computed it at once);
            # keep that one, this copy is freed as plain memory.
            return
        self.block_hashes[block_id] = block_hash
        self.cached[block_hash] = block_id

    def reset(self) -> None:
        """Forget everything: the worker died with its memory, so no cached prefix is valid."""
        self.ref_counts = [0] * self.num_blocks
        self.block_hashes = [None] * self.num_blocks
        self.cached = {}
        self._free = OrderedDict.fromkeys(range(self.num_blocks))

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free
