"""Tensor parallelism: each rank's slice of the weights against the unsharded model's math, a
rank group stepping in lockstep over gloo, a dead rank failing the group at once with a clear
error, the other ranks dying with rank 0, and the errors for what cannot be split.

(TP=2 against TP=1 on the default model, through `tandem run`: tests/test_cli.py.)
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from engine.batch import FROM_LAST_STEP, SeqInput
from engine.config import ModelConfig
from engine.errors import InvalidRequest, RankGroupError
from engine.loader import load_model
from engine.rank_group import EngineArgs, start_engine
from engine.registry import SEED_KEY
from engine.shard import ShardPlan
from engine.tensor_parallel import TensorParallel
from tests.engine.test_gguf_loading import HEAD_DIM, HIDDEN, write_gguf

CPU = torch.device("cpu")
# Sums in another order; int4's activations are bf16; int8 quantizes each rank's slice of a
# row-parallel weight with its own scales.
TOLERANCE = {"none": 1e-5, "auto": 1e-5, "int4": 1e-2, "int8": 3e-2}


def close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()))


def small_config(**changes: int) -> ModelConfig:
    fields = dict(vocab_size=49152, dim=576, n_layers=1, n_heads=9, n_kv_heads=3, ffn_dim=1536,
                  rope_theta=1e4, rms_norm_eps=1e-5, max_seq_len=64, tie_embeddings=False,
                  name="SmolLM2-135M")  # fmt: skip
    return ModelConfig(**{**fields, **changes})


@pytest.mark.parametrize("world", [1, 2, 3])
def test_plans_cover_every_head_row_and_token_once(world: int) -> None:
    config = small_config()
    plans = [ShardPlan.for_model(config, r, world) for r in range(world)]
    for field, total in (("kv_heads", 3), ("q_heads", 9), ("ffn", 1536), ("vocab", 49152)):
        spans = [getattr(p, field) for p in plans]
        assert spans[0][0] == 0 and spans[-1][1] == total
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    for p in plans:
        local = p.local_config(config)
        assert local.n_heads == 3 * local.n_kv_heads  # whole GQA groups
        assert local.head_dim == config.head_dim and local.vocab_size % 16 == 0
        assert local.vocab_size * world >= config.vocab_size
        assert (p.ffn[1] - p.ffn[0]) % 32 == 0  # GGUF blocks split whole


def test_more_ranks_than_kv_heads_is_refused_naming_the_model() -> None:
    with pytest.raises(
        InvalidRequest, match=r"SmolLM2-135M has 3 KV heads.*at most 3 ranks, not 4"
    ):
        ShardPlan.for_model(small_config(), 0, 4)


@pytest.mark.parametrize(
    ("qtype", "quantize"),
    [(Q.Q8_0, "none"), (Q.Q4_0, "auto"), (Q.Q8_0, "auto"), (Q.Q4_1, "int4"), (Q.Q8_0, "int8")],
)
def test_shards_compute_what_the_whole_model_does(tmp_path: Path, qtype: Q, quantize: str) -> None:
    """Two ranks' slices (GGUF codes kept as codes where the mode keeps them) against the whole
    model: column-parallel outputs are its rows, row-parallel partial sums add up to its
    outputs, vocabulary slices are its rows of the embedding and the logits."""
    path = tmp_path / "m.gguf"
    write_gguf(path, qtype)
    whole = load_model(path, CPU, torch.float32, False, quantize)
    tol = TOLERANCE[quantize]
    ranks = [
        load_model(path, CPU, torch.float32, False, quantize, TensorParallel(r, 2)) for r in (0, 1)
    ]
    plans = [ShardPlan.for_model(whole.config, r, 2) for r in (0, 1)]
    c = whole.config
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, HIDDEN, generator=gen)
    heads = torch.randn(3, c.q_dim, generator=gen)
    block = whole.model.blocks()[0]
    q, k, v = block.attention.wqkv(x).split([c.q_dim, c.kv_dim, c.kv_dim], dim=1)
    o = torch.zeros(3, HIDDEN)
    mlp = torch.zeros(3, HIDDEN)
    logits = []
    for loaded, plan in zip(ranks, plans, strict=True):
        mine = loaded.model.blocks()[0]
        local = loaded.model.config
        (q0, q1), (k0, k1), hd = plan.q_heads, plan.kv_heads, HEAD_DIM
        rq, rk, rv = mine.attention.wqkv(x).split([local.q_dim, local.kv_dim, local.kv_dim], 1)
        close(rq, q[:, q0 * hd : q1 * hd], tol)
        close(rk, k[:, k0 * hd : k1 * hd], tol)
        close(rv, v[:, k0 * hd : k1 * hd], tol)
        o += mine.attention.wo.inner(heads[:, q0 * hd : q1 * hd])
        mlp += mine.feed_forward.w2.inner(_silu_mul(mine.feed_forward.w13(x)))
        v0, v1 = plan.vocab
        rows = loaded.model.tok_embeddings.inner.weight
        torch.testing.assert_close(rows[: v1 - v0], whole.model.tok_embeddings.weight[v0:v1])
        scores = loaded.model.output.inner(x)
        assert scores.shape[1] == plan.vocab_rows
        assert not scores[:, v1 - v0 :].any()  # padding rows score zero, and are dropped
        logits.append(scores[:, : v1 - v0])
    close(o, block.attention.wo(heads), tol)
    close(mlp, block.feed_forward(x), tol)
    # The whole head's 300 rows are no multiple of 16: kept codes cannot serve it, packed bf16
    # does; the ranks' padded slices of it are codes.
    head_tol = max(tol, 1e-2) if quantize == "auto" else tol
    close(torch.cat(logits, dim=1), whole.model.output(x), head_tol)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def random_model(folder: Path) -> Path:
    """A 2-layer LLaMA of GQA 4/2 and a small vocabulary: quick to draw on every rank."""
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000,
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, SEED_KEY: 7,
        "_name_or_path": "tp-test-random",
    }  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def args_for(path: Path) -> EngineArgs:
    return EngineArgs(path, kv_cache_bytes=4 << 20, progress=False, max_num_seqs=4, timeout_s=60)


def greedy(engine: object, steps: int) -> list[int]:
    step = engine.step
    prompt, table = [5, 17, 300, 42, 999], list(range(4))
    tokens = [step([SeqInput("s", prompt, 0, table)])[0].token_id]
    for i in range(steps - 1):
        tokens.append(step([SeqInput("s", [tokens[-1]], len(prompt) + i, table)])[0].token_id)
    return tokens


@pytest.mark.slow
def test_a_rank_group_steps_as_one_engine_and_a_dead_rank_fails_it_clearly(
    tmp_path: Path,
) -> None:
    path = random_model(tmp_path / "model")
    alone = start_engine(args_for(path), 1)
    want = greedy(alone, 8)
    engine = start_engine(args_for(path), 2)
    try:
        # kv_cache_bytes is each rank's, whose blocks hold half the KV heads: twice the blocks.
        assert engine.model.config.n_kv_heads == 1
        assert engine.num_kv_blocks == 2 * alone.num_kv_blocks
        assert greedy(engine, 8) == want
        engine.release(["s"])
        with pytest.raises(InvalidRequest, match="block_table"):  # a bad request: the group goes on
            engine.step([SeqInput("bad", [1, 2], 0, [10**6])])
        # Each rank would take its own sample: a group takes the tokens themselves.
        with pytest.raises(InvalidRequest, match="takes no FROM_LAST_STEP"):
            engine.submit([SeqInput("s", [FROM_LAST_STEP], 8, [0, 1])])
        assert greedy(engine, 4) == want[:4]
        follower = engine.followers.followers[0]
        os.kill(follower.pid, signal.SIGKILL)
        # Raised, not hung until a collective's timeout (pytest's timeout would end a hang).
        with pytest.raises(RankGroupError, match=r"rank 1 of 2 \(pid \d+\) was killed by SIGKILL"):
            greedy(engine, 2)
        with pytest.raises(RankGroupError):  # and every step after
            engine.release(["s"])
    finally:
        engine.close()


_ORPHAN = """
import os, sys
from pathlib import Path
from engine.rank_group import EngineArgs, start_engine
engine = start_engine(EngineArgs(Path(sys.argv[1]), kv_cache_bytes=4 << 20, progress=False), 2)
print(engine.followers.followers[0].pid, flush=True)
os.kill(os.getpid(), 9)
"""


@pytest.mark.slow
def test_the_other_ranks_die_with_rank_0(tmp_path: Path) -> None:
    path = random_model(tmp_path / "model")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", _ORPHAN, str(path)],
        capture_output=True, text=True, timeout=120, cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )  # fmt: skip
    assert done.returncode == -signal.SIGKILL, done.stderr
    pid = int(done.stdout.split()[0])
    deadline = time.monotonic() + 60  # bounded, generous: a loaded machine
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)  # not our child: nothing to wait on but its /proc entry
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    """Running, not a zombie (whoever adopted it may not reap it at once)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def test_a_group_needs_a_rank() -> None:
    with pytest.raises(InvalidRequest, match="tensor_parallel_size"):
        start_engine(EngineArgs(Path("unused")), 0)
