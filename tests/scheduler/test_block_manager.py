"""The KV accounts on their own: allocation, reference counts, the prefix cache and its LRU."""

from __future__ import annotations

import pytest

from services.scheduler.block_manager import BlockManager, hash_block


def chain(token_blocks: list[list[int]]) -> list[bytes]:
    out: list[bytes] = []
    for tokens in token_blocks:
        out.append(hash_block(out[-1] if out else None, tokens))
    return out


def test_allocate_and_free_round_trip() -> None:
    bm = BlockManager(8, 4)
    a = bm.allocate(3)
    b = bm.allocate(5)
    assert len(set(a + b)) == 8 and bm.num_free == 0
    with pytest.raises(RuntimeError):
        bm.allocate(1)
    bm.free(a)
    assert bm.num_free == 3 and all(bm.ref_counts[x] == 0 for x in a)
    assert all(bm.ref_counts[x] == 1 for x in b)


def test_hashes_are_chained() -> None:
    h1 = chain([[1, 2], [3, 4]])
    h2 = chain([[9, 9], [3, 4]])
    assert h1[0] != h2[0]
    # Same tokens in the second block, different prefix: a different block.
    assert h1[1] != h2[1]
    assert chain([[1, 2], [3, 4]]) == h1


def test_lookup_returns_the_leading_cached_run_only() -> None:
    bm = BlockManager(8, 2)
    hashes = chain([[1, 2], [3, 4], [5, 6]])
    ids = bm.allocate(3)
    bm.register(ids[0], hashes[0])
    bm.register(ids[2], hashes[2])  # cached, but not reachable: block 1 is missing
    assert bm.lookup(hashes, 3) == [ids[0]]
    bm.register(ids[1], hashes[1])
    assert bm.lookup(hashes, 3) == ids
    assert bm.lookup(hashes, 2) == ids[:2]


def test_shared_blocks_are_ref_counted_and_cached_free_blocks_come_back() -> None:
    bm = BlockManager(4, 2)
    hashes = chain([[1, 2]])
    (block,) = bm.allocate(1)
    bm.register(block, hashes[0])
    bm.acquire([block])
    assert bm.ref_counts[block] == 2
    bm.free([block])
    bm.free([block])
    # Free, but still a cached prefix: a later request takes it back out of the free pool.
    assert bm.is_free(block) and bm.lookup(hashes, 1) == [block]
    assert bm.num_unreferenced([block]) == 1
    bm.acquire([block])
    assert not bm.is_free(block) and bm.ref_counts[block] == 1 and bm.num_free == 3


def test_eviction_takes_empty_blocks_first_then_least_recently_freed() -> None:
    bm = BlockManager(4, 2)
    hashes = chain([[1, 1], [2, 2], [3, 3]])
    a, b, c, d = bm.allocate(4)
    for block, h in zip((a, b, c), hashes, strict=True):
        bm.register(block, h)
    bm.free([a])
    bm.free([b])
    bm.free([d])  # never hashed: the first to be reused
    bm.free([c])
    assert bm.allocate(1) == [d]
    assert bm.num_cached == 3
    assert bm.allocate(1) == [a]  # least recently freed cached block
    assert hashes[0] not in bm.cached and bm.num_evictions == 1
    assert bm.lookup(hashes, 3) == []  # the chain is broken at its first block


def test_register_keeps_the_first_copy_of_a_prefix() -> None:
    bm = BlockManager(4, 2)
    h = chain([[7, 7]])[0]
    a, b = bm.allocate(2)
    bm.register(a, h)
    bm.register(b, h)
    assert bm.cached[h] == a and bm.block_hashes[b] is None


def test_caching_off_never_hits() -> None:
    bm = BlockManager(4, 2, enable_caching=False)
    h = chain([[7, 7]])[0]
    (a,) = bm.allocate(1)
    bm.register(a, h)
    assert bm.lookup([h], 1) == [] and bm.num_cached == 0


def test_reset_forgets_everything() -> None:
    bm = BlockManager(4, 2)
    (a,) = bm.allocate(1)
    bm.register(a, chain([[1, 2]])[0])
    bm.reset()
    assert bm.num_free == 4 and bm.num_cached == 0 and bm.ref_counts == [0] * 4
