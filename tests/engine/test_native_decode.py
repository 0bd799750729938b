"""The default model served from its GGUF codes by the native CPU kernels: the one-call layer
stack of decode steps equals the model's own forward over the same kernels, and the served
logits stay close to the fp32 dequantized model's (the int8 rounding of activations)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import cpu_kernels
from engine.batch import SeqInput
from engine.engine import Engine
from engine.loader import load_model
from engine.tokenizer import load_tokenizer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not cpu_kernels.supported(), reason="the native CPU kernels need x86-64 with AVX-512 VNNI"
    ),
]

PROMPTS = [
    "The capital of France is Paris, and the capital of Italy is Rome; both are old cities.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fib(n - 2)",
    "Le café coûte 3 € à Zürich, et à Tokyo le thé vert est servi très chaud le matin.",
]
PREFILL = 4  # tokens of each prompt prefilled; the rest are fed one decode step at a time


@pytest.fixture(scope="module")
def served(default_gguf: Path) -> Engine:
    loaded = load_model(default_gguf, torch.device("cpu"), torch.float32, False, "auto")
    return Engine(loaded, num_kv_blocks=64)


@pytest.fixture(scope="module")
def prompts(default_gguf: Path) -> list[list[int]]:
    tokenizer = load_tokenizer(default_gguf)
    return [tokenizer.encode_prompt(p, allow_special=False) for p in PROMPTS]


def decode_logits(engine: Engine, prompts: list[list[int]]) -> torch.Tensor:
    """Prefill each prompt's first tokens, then feed the rest one batched decode step at a time
    (the same tokens whatever the model predicts). Returns the logits of every decode row."""
    length = min(len(ids) for ids in prompts)
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(prompts))]
    for i, ids in enumerate(prompts):
        engine.forward([SeqInput(f"s{i}", ids[:PREFILL], 0, tables[i])])
    rows = []
    for pos in range(PREFILL, length):
        batch = [SeqInput(f"s{i}", [ids[pos]], pos, tables[i]) for i, ids in enumerate(prompts)]
        rows.append(engine.model.logits(engine.forward(batch)))  # (B, vocab)
    return torch.cat(rows)


def test_default_model_is_served_natively(served: Engine) -> None:
    assert served.loaded.linear_format == "native-codes"
    assert served.native is not None


def test_native_layer_stack_equals_the_model_forward(served: Engine, prompts) -> None:  # type: ignore[no-untyped-def]
    python_path = Engine(served.loaded, num_kv_blocks=64)
    python_path.native = None  # every layer through engine/model.py's modules
    ours, theirs = decode_logits(served, prompts), decode_logits(python_path, prompts)
    assert ours.shape[0] >= 3 * 10
    assert float((ours - theirs).abs().max() / theirs.abs().max()) <= 1e-5


def test_served_logits_stay_close_to_fp32(default_gguf: Path, served: Engine, prompts) -> None:  # type: ignore[no-untyped-def]
    """Measured on this model: KL 0.005-0.006 nats per token, 97-99% the same top token."""
    fp32 = Engine.from_path(default_gguf, kv_cache_bytes=64 << 20, progress=False, quantize="none")
    ours, reference = decode_logits(served, prompts), decode_logits(fp32, prompts)
    kl = F.kl_div(
        ours.log_softmax(-1), reference.log_softmax(-1), log_target=True, reduction="batchmean"
    )
    assert float(kl) <= 0.02
    assert float((ours.argmax(-1) == reference.argmax(-1)).float().mean()) >= 0.9


def prompt_logits(engine: Engine, ids: list[int], cuts: list[int], seq: str) -> torch.Tensor:
    """The logits of every row of `ids`, run in chunks that end at `cuts` (each chunk after the
    ones before it, as a prompt after a prefix found in the cache runs)."""
    table = list(range(8))
    rows, start = [], 0
    for end in [*cuts, len(ids)]:
        hidden = engine.forward([SeqInput(seq, ids[start:end], start, table)])
        rows.append(engine.model.logits(hidden))
        start = end
    engine.release([seq])
    return torch.cat(rows)


def test_a_prompt_scores_the_same_bit_for_bit_however_it_is_chunked(
    served: Engine, prompts
) -> None:  # type: ignore[no-untyped-def]
    """A prompt's rows whole, in chunks (a cached prefix, a step's token budget), and fed one
    decode at a time: the same logits exactly. Before attention took rows one by one, a chunk
    boundary moved logprobs by up to 0.1 on this model (activations' int8 rounding turns the
    last bit of a row attended in another block of rows into a step of 1/127)."""
    ids = prompts[0]
    whole = prompt_logits(served, ids, [], "whole")
    for cuts in ([5], [16], [len(ids) - 1], [3, 9, 10, len(ids) - 2]):
        assert torch.equal(prompt_logits(served, ids, cuts, "chunks"), whole), cuts
    one_by_one = prompt_logits(served, ids, list(range(1, len(ids))), "decodes")
    assert torch.equal(one_by_one, whole)
    # Beside another prompt in the same step, and with a decode of a third sequence.
    served.forward([SeqInput("third", prompts[2][:6], 0, list(range(16, 24)))])
    batch = [
        SeqInput("other", prompts[1], 0, list(range(8, 16))),
        SeqInput("mixed", ids, 0, list(range(8))),
        SeqInput("third", [prompts[2][6]], 6, list(range(16, 24))),
    ]
    hidden = served.forward(batch)
    mixed = served.model.logits(hidden[len(prompts[1]) : len(prompts[1]) + len(ids)])
    served.release(["other", "mixed", "third"])
    assert torch.equal(mixed, whole)
