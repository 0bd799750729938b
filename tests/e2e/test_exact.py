"""Equality through the real pipeline, where the arithmetic allows it: the default model served
in fp32 with dequantized weights (`--dtype float32 --quantize none`), against the same engine in
this process.

Sampling runs through the worker as it is (seeds, temperature, top-p/k, penalties, logprobs), so
a request alone in its steps must give exactly the engine's tokens. Batched with others, fp32
rounds a little differently; a pick may then differ only where the engine's two best were
within NEAR_TIE nats of each other, a thousand times what fp32 batching changes. Every claim
is made of a single-process worker and of one of two tensor-parallel ranks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.sampling_params import SamplingParams
from harness.pipeline import Pipeline, pipeline
from tandem.v1 import generation_pb2 as pb
from tests.e2e.client import Reference, Streamed, greedy, idle, stats_when, stream

pytestmark = pytest.mark.slow

NEAR_TIE = 1e-3
FP32 = ("--dtype", "float32", "--quantize", "none")
GREEDY = SamplingParams(temperature=0)


# The same claims hold of a worker of two tensor-parallel ranks (gloo): only the order of the
# all-reduce's sums differs from the engine alone.
@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def served(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Pipeline]:
    flags = ("--max-num-seqs", "32", "--tensor-parallel-size", str(request.param), *FP32)
    with pipeline(tmp_path_factory.mktemp("exact"), *flags) as running:
        yield running


@pytest.fixture(scope="module")
def reference(default_gguf: Path) -> Reference:
    return Reference(default_gguf, dtype="float32", quantize="none")


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def assert_greedy(reference: Reference, got: Streamed) -> None:
    """Every pick is the engine's best on the same history, but at a near tie."""
    tops = reference.forced(got.prompt_ids, got.token_ids)
    for k, (top, token) in enumerate(zip(tops, got.token_ids, strict=True)):
        if token != top[0][0]:
            assert top[0][1] - top[1][1] < NEAR_TIE, f"token {k}: {token}, the engine's {top}"


def test_batched_streams_are_the_engines_greedy_tokens(
    served: Pipeline, reference: Reference
) -> None:
    prompts = ["Tell me about the moon.", "What is 2+2?", "List three fruits."]

    async def run_all() -> list[Streamed]:
        requests = [greedy(chat=prompts[i % 3], max_tokens=12) for i in range(24)]
        return await asyncio.gather(*(stream(served.address, r) for r in requests))

    for got in run(run_all()):
        assert got.finish_reason in ("stop", "length")
        assert_greedy(reference, got)


SAMPLED = [
    pb.SamplingParams(temperature=0.8, seed=7),
    pb.SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=11),
    pb.SamplingParams(temperature=0.7, min_p=0.05, seed=3),
    pb.SamplingParams(
        temperature=0.9,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        seed=5,
    ),
]


def sampling_of(params: pb.SamplingParams, logprobs: int = 0) -> SamplingParams:
    return SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p if params.HasField("top_p") else 1.0,
        top_k=params.top_k,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty or 1.0,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        seed=params.seed,
        logprobs=logprobs,
    )


@pytest.mark.parametrize("params", SAMPLED, ids=["temperature", "top-p-k", "min-p", "penalties"])
def test_seeded_sampling_alone_is_the_engines(
    served: Pipeline, reference: Reference, params: pb.SamplingParams
) -> None:
    request = pb.GenerateRequest(
        text="Once upon a time", max_tokens=24, ignore_eos=True, sampling=params, logprobs=3
    )
    got = run(stream(served.address, request))
    again = run(stream(served.address, request))
    want = reference.generate(got.prompt_ids, 24, sampling_of(params, logprobs=3), ignore_eos=True)
    assert got.token_ids == want.token_ids
    assert again.token_ids == got.token_ids  # a seed makes it reproducible
    # Each token's logprob and its top three are the engine's.
    tops = reference.forced(got.prompt_ids, got.token_ids, sampling_of(params))
    for token, lp, top in zip(got.token_ids, got.logprobs, tops, strict=True):
        assert lp.token_id == token
        assert [t.token_id for t in lp.top_logprobs] == [t for t, _ in top[:3]]
        assert [t.logprob for t in lp.top_logprobs] == pytest.approx(
            [p for _, p in top[:3]], abs=1e-4
        )
        chosen = dict(top).get(token)
        if chosen is not None:
            assert lp.logprob == pytest.approx(chosen, abs=1e-4)


def test_different_seeds_sample_differently(served: Pipeline) -> None:
    def sampled(seed: int) -> list[int]:
        params = pb.SamplingParams(temperature=1.0, seed=seed)
        request = pb.GenerateRequest(text="My favourite", max_tokens=16, sampling=params)
        return run(stream(served.address, request)).token_ids

    assert len({tuple(sampled(seed)) for seed in (1, 2, 3)}) > 1


def test_penalties_after_a_prefix_cache_hit(served: Pipeline, reference: Reference) -> None:
    # The second request finds the prompt's blocks cached: the worker runs only its tail, and
    # must still count the whole prompt in the penalties (it is told the cached ids once).
    params = pb.SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.8)
    text = "the cat sat on the mat and the cat sat on the mat and " * 4
    request = pb.GenerateRequest(text=text, max_tokens=24, ignore_eos=True, sampling=params)
    first = run(stream(served.address, request))
    second = run(stream(served.address, request))
    assert first.usage is not None and second.usage is not None
    assert first.usage.cached_prompt_tokens == 0 and second.usage.cached_prompt_tokens >= 32
    want = reference.generate(first.prompt_ids, 24, sampling_of(params), ignore_eos=True)
    assert first.token_ids == second.token_ids == want.token_ids
    # Without its penalty history the tail-only run would repeat what the prompt says.
    plain = reference.generate(second.prompt_ids, 24, GREEDY, ignore_eos=True)
    assert plain.token_ids != second.token_ids


def test_a_session_keeps_its_turns_cached(served: Pipeline, reference: Reference) -> None:
    async def conversation() -> tuple[Streamed, Streamed, object]:
        first_turn = greedy(chat="Name three rivers in Europe.", max_tokens=24, session_id="s1")
        one = await stream(served.address, first_turn)
        second_turn = pb.GenerateRequest(
            max_tokens=16, sampling=pb.SamplingParams(temperature=0), session_id="s1"
        )
        for role, content in (
            ("user", "Name three rivers in Europe."),
            ("assistant", one.text),
            ("user", "Which is the longest?"),
        ):
            second_turn.chat.messages.add(role=role, content=content)
        two = await stream(served.address, second_turn)
        after = await stats_when(served.scheduler_address, idle, "the turns to end")
        return one, two, after

    one, two, after = run(conversation())
    # The session's pin is the only KV held once idle, and Stats says so.
    assert after.kv_blocks_used == after.kv_blocks_session_pinned > 0  # type: ignore[attr-defined]
    assert two.usage is not None
    # The whole first prompt, in full blocks, is still cached for the second turn.
    assert two.usage.cached_prompt_tokens >= len(one.prompt_ids) // 16 * 16 > 0
    assert two.prompt_ids[: len(one.prompt_ids)] == one.prompt_ids
    assert_greedy(reference, two)


@pytest.fixture(scope="module")
def transformers_model(default_gguf: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        default_gguf.parent, gguf_file=default_gguf.name, dtype=torch.float32
    ).eval()


# Long enough to be prefilled in chunks (a prompt past 512 tokens is long).
LONG_TEXT = " ".join(
    f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7} marbles." for i in range(60)
)


def test_prompt_logprobs_are_transformers_log_softmax(
    served: Pipeline,
    transformers_model,  # type: ignore[no-untyped-def]
) -> None:
    async def scored_beside_others() -> tuple[Streamed, Streamed, Streamed]:
        unscored = greedy(LONG_TEXT, max_tokens=4)
        scored = greedy(LONG_TEXT, max_tokens=4, prompt_logprobs=2)
        await stream(served.address, unscored)  # its blocks are cached now
        others = [stream(served.address, greedy(chat="Hello!", max_tokens=8)) for _ in range(3)]
        one, *_ = await asyncio.gather(stream(served.address, scored), *others)
        short = await stream(served.address, greedy("Paris is", max_tokens=2, prompt_logprobs=0))
        return one, short, await stream(served.address, unscored)

    one, short, cached = run(scored_beside_others())
    assert cached.usage is not None and cached.usage.cached_prompt_tokens > 0
    # The scored prompt is computed whole: the cached prefix is not taken.
    assert one.usage is not None and one.usage.cached_prompt_tokens == 0
    assert len(one.prompt_ids) > 512
    for got, top_n in ((one, 2), (short, 0)):
        ids = got.prompt_ids
        with torch.no_grad():
            logits = transformers_model(torch.tensor([ids])).logits[0]
        expected = torch.log_softmax(logits.float(), dim=-1)[:-1]  # position p scores p + 1
        assert [e.token_id for e in got.prompt_logprobs] == ids[1:]
        ours = torch.tensor([e.logprob for e in got.prompt_logprobs])
        want = expected[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        assert torch.allclose(ours, want, atol=2e-3), float((ours - want).abs().max())
        best = expected.max(dim=-1)
        for k, entry in enumerate(got.prompt_logprobs):
            # Rank 1 exactly where the token is transformers' best (but at a near tie).
            if abs(float(best.values[k] - want[k])) > NEAR_TIE:
                assert (entry.rank == 1) == (int(best.indices[k]) == ids[k + 1])
            assert len(entry.top_logprobs) == top_n
            if top_n:
                assert entry.top_logprobs[0].logprob == pytest.approx(
                    float(best.values[k]), abs=2e-3
                )
