"""Our forward pass equals transformers' LlamaForCausalLM on the same random weights (fp32)."""

from __future__ import annotations

import torch

from engine.batch import SeqInput


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours - reference).abs().max() / reference.abs().max())


def reference_logits(reference, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return reference(torch.tensor([ids])).logits[0]


def test_full_forward_matches_transformers(tiny_pair) -> None:  # type: ignore[no-untyped-def]
    reference, engine = tiny_pair
    gen = torch.Generator().manual_seed(0)
    # 100 positions: past the llama3 variant's original context of 32, so scaling matters.
    ids = torch.randint(0, engine.config.vocab_size, (100,), generator=gen).tolist()
    table = list(range(25))
    hidden = engine.forward([SeqInput("s", ids, 0, table)])
    ours = engine.model.logits(hidden)
    assert relative_error(ours, reference_logits(reference, ids)) <= 1e-4


def test_config_read_from_checkpoint(tiny_pair) -> None:  # type: ignore[no-untyped-def]
    reference, engine = tiny_pair
    hf = reference.config
    ours = engine.config
    assert ours.n_kv_heads == hf.num_key_value_heads
    assert ours.tie_embeddings == hf.tie_word_embeddings
    assert ours.rope_theta == hf.rope_theta
    assert (ours.rope_scaling is not None) == (hf.rope_scaling is not None)
    with torch.no_grad():  # the head's weight, however it is stored (plain or packed)
        head = engine.model.output(torch.eye(ours.dim)).T  # (vocab, dim)
    tied = torch.allclose(head, engine.model.tok_embeddings.weight, atol=1e-6)
    assert tied == hf.tie_word_embeddings


def test_prefill_then_decode_through_paged_cache_equals_full_forward(tiny_pair) -> None:  # type: ignore[no-untyped-def]
    reference, engine = tiny_pair
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, engine.config.vocab_size, (60,), generator=gen).tolist()
    expected = reference_logits(reference, ids)
    # Scattered, out-of-order blocks: position p lives in table[p // 4].
    table = [40, 3, 17, 9, 31, 0, 22, 5, 12, 38, 27, 14, 1, 33, 8]
    prefill, rest = 23, ids[23:]
    hidden = engine.forward([SeqInput("s", ids[:prefill], 0, table)])
    rows = [engine.model.logits(hidden)[-1]]
    # A second chunk that starts mid-block, then single-token decodes.
    hidden = engine.forward([SeqInput("s", rest[:10], prefill, table)])
    rows.append(engine.model.logits(hidden)[-1])
    for offset, token in enumerate(rest[10:], start=prefill + 10):
        hidden = engine.forward([SeqInput("s", [token], offset, table)])
        rows.append(engine.model.logits(hidden)[-1])
    ours = torch.stack(rows)
    positions = [prefill - 1, prefill + 9, *range(prefill + 10, len(ids))]
    assert relative_error(ours, expected[positions]) <= 1e-4
