"""Serving on CUDA after start: no kernel left to compile, whatever the workload's shapes.
Marked `gpu`: skipped where there is no CUDA device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.serving import run_workload
from engine import registry
from engine.batch import FROM_LAST_STEP, SeqInput
from engine.engine import Engine
from engine.sampling_params import GREEDY, SamplingParams

pytestmark = pytest.mark.gpu


def test_no_kernel_is_compiled_after_the_start(tandem_home: Path) -> None:
    path = registry.resolve("llama3-tiny-random", tandem_home)
    engine = Engine.from_path(path, "cuda", "bfloat16", 512 << 20, progress=False)
    assert engine.start_times["warm_up"] > 0
    gen = torch.Generator().manual_seed(0)
    vocab = engine.config.vocab_size
    for n, longest in ((3, 40), (40, 700), (256, 300)):  # batch sizes of every attention variant
        lengths = torch.randint(1, longest, (n,), generator=gen).tolist()
        prompts = [torch.randint(0, vocab, (k,), generator=gen).tolist() for k in lengths]
        run = run_workload(engine, prompts, 24, profile=False)
        assert run.output_tokens == 24 * n
        assert run.compiles == [], run.compiles


@pytest.mark.parametrize("start", [0, 300])  # a whole prompt (flash, GQA as is); a continuation
def test_prefill_attention_matches_fp32(start: int) -> None:
    from engine.attention import _prefill

    torch.manual_seed(0)
    heads, kv_heads, hd, q_len = 32, 8, 128, 211
    ctx = start + q_len
    q = torch.randn(heads, q_len, hd, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(kv_heads, ctx, hd, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(kv_heads, ctx, hd, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(ctx, device="cuda")
    mask = pos[None, :] <= pos[start:, None]  # (q_len, ctx)
    got = _prefill(q, k, v, mask if start else None)
    kf, vf = (x.float().repeat_interleave(heads // kv_heads, 0) for x in (k, v))
    scores = torch.einsum("hqd,hkd->hqk", q.float(), kf) / hd**0.5
    want = torch.einsum("hqk,hkd->hqd", scores.masked_fill(~mask, float("-inf")).softmax(-1), vf)
    assert float((got.float() - want).norm() / want.norm()) < 1e-2


def _drive(engine: Engine, ahead: bool) -> dict[str, list[int]]:
    """Sequence a alone (batch-1 graph steps, replayed ahead), b joining (mixed eager steps), c
    joining, then decodes of three (graph steps): one step at a time with the tokens in hand, or
    each submitted before the last is collected, its decodes taking FROM_LAST_STEP."""
    gen = torch.Generator().manual_seed(5)
    vocab = engine.config.vocab_size
    prompts = {s: torch.randint(0, vocab, (n,), generator=gen).tolist() for s, n in
               (("a", 20), ("b", 33), ("c", 7))}  # fmt: skip
    joins = {"a": 0, "b": 4, "c": 6}
    sampling = {"a": GREEDY, "b": SamplingParams(temperature=0.7, seed=3), "c": GREEDY}
    tables = {s: list(range(8 * i, 8 * i + 8)) for i, s in enumerate(prompts)}
    out: dict[str, list[int]] = {s: [] for s in prompts}
    pending = None
    for k in range(12):
        batch = []
        for s, prompt in prompts.items():
            if k < joins[s]:
                continue
            if k == joins[s]:
                batch.append(SeqInput(s + str(ahead), prompt, 0, tables[s], sampling[s]))
                continue
            token = FROM_LAST_STEP if ahead else out[s][-1]
            pos = len(prompt) + k - joins[s] - 1
            batch.append(SeqInput(s + str(ahead), [token], pos, tables[s], sampling[s]))
        if not ahead:
            outputs = engine.step(batch)
        else:
            queued = engine.submit(batch)
            outputs = engine.collect(pending) if pending is not None else []
            pending = queued
        for o in outputs:
            out[str(o.seq_id)[0]].append(o.token_id)
    if pending is not None:
        for o in engine.collect(pending):
            out[str(o.seq_id)[0]].append(o.token_id)
    engine.release(s + str(ahead) for s in prompts)
    return out


def test_steps_submitted_ahead_on_cuda_equal_steps_one_at_a_time(tandem_home: Path) -> None:
    path = registry.resolve("llama3-tiny-random", tandem_home)
    engine = Engine.from_path(path, "cuda", "bfloat16", 512 << 20, progress=False)
    expected = _drive(engine, ahead=False)
    assert [len(t) for t in expected.values()] == [12, 8, 6]
    assert _drive(engine, ahead=True) == expected


def test_launching_a_step_never_waits_for_the_device(tandem_home: Path) -> None:
    """Engine.submit returns while the step before it runs, whatever the step carries: a chunk
    that continues a long prompt, penalties, logit bias, min_tokens, sampling. A launch that
    waited would hold the tokens of the step before it (the worker's overlap)."""
    path = registry.resolve("llama3-tiny-random", tandem_home)
    engine = Engine.from_path(path, "cuda", "bfloat16", 512 << 20, progress=False)
    vocab, bs = engine.config.vocab_size, engine.block_size
    gen = torch.Generator().manual_seed(3)

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    fussy = SamplingParams(
        temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, seed=4, logprobs=3,
        repetition_penalty=1.2, presence_penalty=0.4, frequency_penalty=0.3,
        logit_bias=((5, 2.0), (9, -1.0)), min_tokens=50, stop_token_ids=(2,),
    )  # fmt: skip
    chunk = SeqInput("chunk", ids(1000), 1000, list(range(2000 // bs + 1)), sample=False)
    batch = [
        chunk,
        SeqInput("fussy", ids(40), 0, [200, 201, 202], fussy, prompt_len=40),
        SeqInput("sampled", ids(30), 0, [210, 211], SamplingParams(temperature=0.7, seed=1)),
    ]
    engine.step(batch)  # its kernels compiled
    engine.release(["fussy", "sampled"])
    torch.cuda.set_sync_debug_mode("error")
    try:
        submitted = engine.submit(batch)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert [out.seq_id for out in engine.collect(submitted)] == ["fussy", "sampled"]
