"""transformers' `generate` on the same random weights as the engine: the rows bench.gpu sets
beside tandem's."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from engine.random_weights import RandomWeights


def hf_model(path: Path, engine_config: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    source = RandomWeights(engine_config, 0, torch.device("cuda"), torch.bfloat16)
    model.load_state_dict({n: source.get(n) for n in source.names()}, assign=True, strict=False)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config, device="cuda")
    return model.eval()


def hf_generate(model: Any, batch: int, prompt_len: int, new: int, static: bool) -> float:
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), device="cuda")
    kwargs: dict[str, Any] = dict(
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        attention_mask=torch.ones_like(ids),
        pad_token_id=0,
    )
    if static:
        # A static cache without torch.compile, which would add minutes of compiling here.
        kwargs["cache_implementation"] = "static"
        kwargs["disable_compile"] = True
    with torch.no_grad():
        model.generate(ids, **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, **kwargs)
        torch.cuda.synchronize()
    return batch * new / (time.perf_counter() - start)
