"""The hardware floors bench/gpu.py reports against count the work a step does: a decode step
reads the head but only one row of an untied embedding table, and a prefill multiplies every
token through the layers but only its sampled row through the head."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from bench.gpu_measure import prefill_params, weight_bytes
from bench.serving import workload_floor
from engine.batch import SeqInput
from engine.engine import Engine
from engine.submitted import Submitted
from tests.engine.conftest import TINY, write_tiny_checkpoint

HIDDEN, FFN, LAYERS, VOCAB = 64, 160, 2, 320
KV_WIDTH = 2 * 16  # two KV heads of 16
# Per layer: q and o (64 x 64), k and v (32 x 64), gate, up and down (64 x 160), two norms.
LAYER = 2 * HIDDEN * HIDDEN + 2 * KV_WIDTH * HIDDEN + 3 * HIDDEN * FFN + 2 * HIDDEN
LAYERS_AND_FINAL_NORM = LAYERS * LAYER + HIDDEN
TABLE = VOCAB * HIDDEN


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    folder: Path = tmp_path_factory.mktemp("floors")
    write_tiny_checkpoint(folder, tie_word_embeddings=request.param)
    # Plain nn.Linear projections, as on CUDA (the CPU default packs them for oneDNN).
    return Engine.from_path(
        folder, kv_cache_bytes=1 << 20, block_size=4, progress=False, quantize="none"
    )


def test_the_tiny_model_is_the_one_counted_here() -> None:
    assert (TINY["hidden_size"], TINY["intermediate_size"]) == (HIDDEN, FFN)
    assert (TINY["num_hidden_layers"], TINY["vocab_size"]) == (LAYERS, VOCAB)


def test_a_decode_step_reads_the_head_and_not_the_embedding_table(engine: Engine) -> None:
    element = engine.model.norm.weight.element_size()
    # Tied or not, the head's matrix is read once and the table's other rows never.
    assert weight_bytes(engine) == (LAYERS_AND_FINAL_NORM + TABLE) * element


def test_a_prefill_multiplies_tokens_through_the_layers_and_one_row_through_the_head(
    engine: Engine,
) -> None:
    assert prefill_params(engine) == (LAYERS_AND_FINAL_NORM, TABLE)


def test_the_workload_floor_adds_prefill_flops_and_decode_bytes(engine: Engine) -> None:
    c = engine.config
    per_token, head = prefill_params(engine)
    flops, bandwidth, read = 1e12, 1e12, weight_bytes(engine)
    # One prompt of 10 tokens and 3 output tokens: a prefill, then 2 decode steps, whose
    # attention reads 11 and 12 positions.
    attention = 2 * c.n_layers * c.q_dim * 10 * 11
    kv_token = 2 * c.n_layers * c.kv_dim * 2
    expected = (2 * per_token * 10 + 2 * head + attention) / flops + (
        2 * read + (11 + 12) * kv_token
    ) / bandwidth
    floor = workload_floor(c, (per_token, head), read, [10], 3, flops, bandwidth)
    assert floor == pytest.approx(expected)


def test_a_row_shows_its_ratio_to_the_burst_floor_and_the_sustained_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from bench import gpu_table

    before = len(gpu_table.ROWS)
    try:
        gpu_table.row("TTFT", "engine", 50.0, "ms", 40.0, 45.0)
        gpu_table.row("workload", "engine", 80.0, "tok/s", 100.0, 90.0)
        gpu_table.row("decode", "engine", 80.0, "tok/s", 100.0)
        ttft, workload, decode = gpu_table.ROWS[before:]
    finally:
        del gpu_table.ROWS[before:]
    assert (ttft["ratio"], ttft["sustained_ratio"]) == (1.25, pytest.approx(50 / 45))
    assert workload["sustained_ratio"] == pytest.approx(80 / 90)
    assert "sustained_ratio" not in decode  # no prefill FLOPs in its floor
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].endswith("1.25x floor (sustained: 1.11x)")
    assert printed[1].endswith("80.0% (sustained: 88.9%)")
    assert printed[2].endswith("80.0%")


@pytest.mark.parametrize("overlapped", [False, True], ids=["one at a time", "overlapped"])
def test_decode_steps_read_on_average_the_context_their_roofline_counts(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, overlapped: bool
) -> None:
    from bench import gpu_measure

    attended: list[int] = []  # positions a decode row attends over: its own and those before
    submit = engine.submit  # engine.step submits too

    def recording(batch: Sequence[SeqInput]) -> Submitted:
        attended.extend(s.start_pos + 1 for s in batch if s.start_pos > 0)
        return submit(batch)

    monkeypatch.setattr(engine, "submit", recording)
    gpu_measure.decode_steps(engine, 2, 12, 8, overlapped)
    assert len(attended) == 2 * 8
    # bench/gpu.py's step roofline charges each sequence `context` tokens of K/V.
    assert sum(attended) / len(attended) == 12.5


def test_a_profiled_workload_runs_and_leaves_the_engine_as_it_found_it(engine: Engine) -> None:
    """bench.gpu's in-process workloads time the engine's phases by wrapping its methods in
    place (bench/serving.py's StepProfile); twice in a row, each run unwrapped after it."""
    from bench.serving import run_workload, summarize_steps

    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    for _ in range(2):
        run = run_workload(engine, prompts, 3)
        assert run.output_tokens == 2 * 3
        assert summarize_steps(run.steps, 2)["decode_prepare_us"] > 0
    assert "decode_arrays" not in vars(engine.checks)
