"""On the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF), greedy continuations equal
transformers' loading the same GGUF (dequantized to fp32), fed the same prompt ids."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.engine import Engine
from engine.generate import Generation, GenerationRequest, generate
from engine.sampling_params import GREEDY
from engine.tokenizer import Tokenizer, load_tokenizer

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
# Beyond this step the reference's best two logits are so close that fp32 rounding may pick
# either; continuations are compared only up to the first such near-tie.
NEAR_TIE = 0.02


@pytest.fixture(scope="module")
def reference(default_gguf: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        default_gguf.parent, gguf_file=default_gguf.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def engine(default_gguf: Path) -> Engine:
    # Dequantized fp32, as transformers serves it: the comparison is exact up to rounding.
    return Engine.from_path(default_gguf, kv_cache_bytes=64 << 20, progress=False, quantize="none")


@pytest.fixture(scope="module")
def tokenizer(default_gguf: Path) -> Tokenizer:
    return load_tokenizer(default_gguf)


def prompt_ids(tokenizer: Tokenizer, kind: str) -> list[int]:
    if kind == "chat":
        messages = [{"role": "user", "content": "What is the boiling point of water?"}]
        return tokenizer.encode(tokenizer.apply_chat_template(messages), allow_special=True)
    text = {
        "plain": "The capital of France is",
        "non_ascii": "Le café coûte 3 € à Zürich, et à Tokyo, 東京の天気は",
        "code": "def fibonacci(n):\n    if n < 2:\n        return n\n",
    }[kind]
    return tokenizer.encode_prompt(text, allow_special=False)


@pytest.mark.parametrize("kind", ["plain", "chat", "non_ascii", "code"])
def test_greedy_continuation_equals_transformers(
    reference,
    engine: Engine,
    tokenizer: Tokenizer,
    kind: str,  # type: ignore[no-untyped-def]
) -> None:
    ids = prompt_ids(tokenizer, kind)
    with torch.no_grad():
        ref = reference.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=None,
            pad_token_id=0,
        )
    ref_tokens = ref.sequences[0, len(ids) :].tolist()
    comparable = NEW_TOKENS
    for step, logits in enumerate(ref.logits):
        top2 = logits[0].topk(2).values
        if float(top2[0] - top2[1]) < NEAR_TIE:
            comparable = step + 1  # this step's token itself may go either way
            break
    request = GenerationRequest(ids, GREEDY, max_tokens=NEW_TOKENS)
    ours = Generation()
    for _ in generate(engine, tokenizer, request, ours):
        pass
    assert comparable >= 8, f"{kind}: reference near-tie too early to compare ({comparable})"
    assert ours.token_ids[: comparable - 1] == ref_tokens[: comparable - 1]


def test_prompt_logits_match_transformers(reference, engine: Engine, tokenizer: Tokenizer) -> None:  # type: ignore[no-untyped-def]
    from engine.batch import SeqInput

    ids = prompt_ids(tokenizer, "chat")
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    table = list(range(-(-len(ids) // engine.block_size)))
    ours = engine.model.logits(engine.forward([SeqInput("p", ids, 0, table)]))
    assert float((ours - expected).abs().max() / expected.abs().max()) <= 1e-4
