"""A KV cache the machine cannot hold is refused at load with a message that says how much
would fit, before the pool is allocated (on a CPU the kernel's OOM killer found it before:
`--kv-cache-mb 999999999` had the worker killed and restarted, and other processes at risk)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import memory
from engine.engine import Engine
from engine.errors import InvalidRequest
from tests.engine.conftest import write_tiny_checkpoint

MIB = 1 << 20
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-memory")
    write_tiny_checkpoint(folder, seed=2)
    return folder


def _free_memory(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    monkeypatch.setattr(memory, "_meminfo_available", lambda: free)
    monkeypatch.setattr(memory, "_cgroup_headroom", lambda: None)


def test_a_kv_cache_beyond_the_memory_left_is_refused_naming_what_fits(
    tiny_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reserve = memory.activation_reserve(CPU, 8, 2048, vocab_size=320)
    _free_memory(monkeypatch, reserve + 3 * MIB)
    with pytest.raises(InvalidRequest) as refused:
        Engine.from_path(tiny_folder, kv_cache_bytes=4 * MIB, max_num_seqs=8, progress=False)
    assert refused.value.field == "kv_cache_mb"
    message = str(refused.value)
    assert "a KV cache of 4 MiB does not fit on cpu" in message
    assert f"{reserve // MIB} MiB stay free for activations" in message
    assert message.endswith("give --kv-cache-mb 3 or less")


def test_the_ranks_of_a_group_on_one_cpu_are_counted_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each rank checks before any has allocated: each must ask for its share of the room."""
    _free_memory(monkeypatch, 2 * (100 + 4) * MIB)
    memory.check_kv_pool_fits(4 * MIB, 100 * MIB, CPU, ranks=2)
    with pytest.raises(InvalidRequest) as refused:
        memory.check_kv_pool_fits(5 * MIB, 100 * MIB, CPU, ranks=2)
    message = str(refused.value)
    assert "a KV cache of 5 MiB for each of 2 ranks does not fit on cpu" in message
    assert message.endswith("give --kv-cache-mb 4 or less")


def test_a_kv_cache_that_fits_beside_the_reserve_loads(
    tiny_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reserve = memory.activation_reserve(CPU, 8, 2048, vocab_size=320)
    _free_memory(monkeypatch, reserve + 4 * MIB)
    engine = Engine.from_path(tiny_folder, kv_cache_bytes=4 * MIB, max_num_seqs=8, progress=False)
    assert engine.num_kv_blocks > 0


def test_where_the_free_memory_cannot_be_read_nothing_is_refused(
    tiny_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(memory, "_meminfo_available", lambda: None)
    monkeypatch.setattr(memory, "_cgroup_headroom", lambda: None)
    assert memory.available_bytes(CPU) is None
    Engine.from_path(tiny_folder, kv_cache_bytes=4 * MIB, max_num_seqs=8, progress=False)


def test_free_memory_is_the_hosts_or_the_containers_whichever_is_less(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  24000000 kB\nMemFree:  1000 kB\nMemAvailable:  2048 kB\n")
    assert memory._meminfo_available(meminfo) == 2048 * 1024
    assert memory._meminfo_available(tmp_path / "absent") is None

    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text("max\n")
    assert memory._cgroup_headroom(cgroup) is None  # no limit: the host's figure stands
    (cgroup / "memory.max").write_text(f"{1000 * MIB}\n")
    (cgroup / "memory.current").write_text(f"{700 * MIB}\n")
    (cgroup / "memory.stat").write_text(f"anon {600 * MIB}\ninactive_file {50 * MIB}\n")
    # The page cache the kernel would drop before the container's OOM counts as free.
    assert memory._cgroup_headroom(cgroup) == 350 * MIB
    (cgroup / "memory.current").write_text(f"{1100 * MIB}\n")
    assert memory._cgroup_headroom(cgroup) == 0


def test_on_a_cpu_the_logits_reserved_are_those_of_the_largest_step() -> None:
    """A decode step has at most the step budget's rows: --max-num-seqs 100000 on a CPU asked
    for 38 GB of logits and was refused with a KV cache of 1 GiB."""
    vocab = 49_152
    assert memory.activation_reserve(CPU, 100_000, 2048, vocab) == 2048 * vocab * 8 + 512 * MIB
    assert memory.activation_reserve(CPU, 64, 2048, vocab) == 64 * vocab * 8 + 512 * MIB
    cuda = torch.device("cuda")  # its graphs hold logits for every row they may replay
    assert memory.activation_reserve(cuda, 100_000, 2048, vocab) == 100_000 * vocab * 8 + (2 << 30)


def test_a_reserve_beyond_the_memory_left_names_the_setting_that_asks_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _free_memory(monkeypatch, 100 * MIB)
    with pytest.raises(InvalidRequest) as refused:
        memory.check_kv_pool_fits(4 * MIB, 200 * MIB, CPU)
    assert refused.value.field == "max_num_seqs"
    assert "not enough for the 200 MiB kept for activations" in str(refused.value)


def test_a_cpu_kv_pool_is_zeroed_and_starts_on_a_huge_page() -> None:
    from engine.config import ModelConfig
    from engine.kv_cache import KVCache
    from engine.memory import HUGE_PAGE, huge_page_buffer

    buffer = huge_page_buffer(3 * HUGE_PAGE + 5, "a test")
    assert buffer.numel() == 3 * HUGE_PAGE + 5 and buffer.data_ptr() % HUGE_PAGE == 0
    config = ModelConfig(
        vocab_size=32, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=128,
        rope_theta=1e4, rms_norm_eps=1e-5, max_seq_len=64, tie_embeddings=True,
    )  # fmt: skip
    kv = KVCache(config, num_blocks=5, block_size=4, dtype=torch.float32, device=CPU)
    assert kv.pool.shape == (3, 20, 2, 2, 16) and kv.pool.dtype == torch.float32
    assert kv.pool.is_contiguous() and kv.pool.data_ptr() % HUGE_PAGE == 0
    assert not kv.pool.any()
    kv.layer(2)[19] = 1.0  # the last slot of the last layer is inside the buffer
    assert kv.pool.sum() == 2 * 2 * 16
