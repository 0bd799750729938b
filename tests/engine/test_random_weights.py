"""Random models of real shapes: seeded, named like a checkpoint, equal to transformers' model
built from the same draws."""

from __future__ import annotations

from pathlib import Path

import torch

from engine import registry
from engine.batch import SeqInput
from engine.engine import Engine
from engine.random_weights import RandomWeights
from engine.tokenizer import load_tokenizer


def test_tiny_random_model_matches_transformers_on_the_same_draws(tandem_home: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    path = registry.resolve("llama3-tiny-random", tandem_home)
    engine = Engine.from_path(path, kv_cache_bytes=8 << 20, progress=False)
    assert engine.loaded.weight_format == "random"
    assert load_tokenizer(path).vocab_size == engine.config.vocab_size == 128256
    source = RandomWeights(engine.config, 0, torch.device("cpu"), torch.float32)
    reference = LlamaForCausalLM(LlamaConfig.from_pretrained(path)).eval()
    reference.load_state_dict({name: source.get(name) for name in source.names()})
    ids = torch.randint(0, 128256, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    ours = engine.model.logits(engine.forward([SeqInput("s", ids, 0, list(range(3)))]))
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    assert float((ours - expected).abs().max() / expected.abs().max()) <= 1e-4


def test_draws_are_reproducible_and_distinct(tandem_home: Path) -> None:
    path = registry.resolve("llama3-tiny-random", tandem_home)
    config = Engine.from_path(path, kv_cache_bytes=8 << 20, progress=False).config
    a = RandomWeights(config, 0, torch.device("cpu"), torch.float32)
    b = RandomWeights(config, 0, torch.device("cpu"), torch.float32)
    name = "model.layers.1.mlp.up_proj.weight"
    assert torch.equal(a.get(name), b.get(name))
    assert not torch.equal(a.get(name), a.get("model.layers.0.mlp.up_proj.weight"))
    assert a.get(name).shape == (config.ffn_dim, config.dim)
