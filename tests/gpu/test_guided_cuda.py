"""Guided decoding on CUDA: held rows through decode graphs (a row alone, whose next step is
replayed ahead, and rows beside free ones), checked by jsonschema. Marked `gpu`."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from engine import registry
from engine.batch import FROM_LAST_STEP, SeqInput
from engine.engine import Engine
from engine.guided import OutputFormat, compile_format, grammar_tokenizer
from engine.sampling_params import SamplingParams
from engine.tokenizer import load_tokenizer

pytestmark = pytest.mark.gpu

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model(tandem_home: Path) -> Path:
    return registry.resolve(registry.DEFAULT_MODEL, tandem_home)


def run(
    engine: Engine, rows: dict[str, SamplingParams], ids: list[int], steps: int
) -> dict[str, list[int]]:
    """Each row's tokens, every decode taking the token of the step before (FROM_LAST_STEP)."""
    eos = set(engine.guides.tokenizer.eos_tokens) if engine.guides else set()
    per_row = -(-(len(ids) + steps + 1) // engine.block_size)
    tables = {name: list(range(i * per_row, (i + 1) * per_row)) for i, name in enumerate(rows)}
    out: dict[str, list[int]] = {name: [] for name in rows}
    batch = [SeqInput(n, ids, 0, tables[n], p, prompt_len=len(ids)) for n, p in rows.items()]
    for i in range(steps):
        for o in engine.step(batch):
            out[str(o.seq_id)].append(o.token_id)
        batch = [
            SeqInput(n, [FROM_LAST_STEP], len(ids) + i, tables[n], p, prompt_len=len(ids))
            for n, p in rows.items()
            if out[n][-1] not in eos
        ]
        if not batch:
            break
    engine.release(list(rows))
    return out


def test_held_rows_through_cuda_graphs_keep_to_their_schema(model: Path) -> None:
    engine = Engine.from_path(model, "cuda", "bfloat16", 64 << 20, progress=False, max_num_seqs=8)
    assert engine.graphs is not None
    tokenizer = load_tokenizer(model)
    grammar = compile_format(
        OutputFormat("json_schema", json.dumps(PERSON)),
        grammar_tokenizer(tokenizer, tokenizer.vocab_size),
    )
    ids = tokenizer.encode_chat([{"role": "user", "content": "Describe a person called Ann."}])
    held = SamplingParams(temperature=0, grammar=grammar)
    free = SamplingParams(temperature=0)

    def check(tokens: list[int]) -> None:
        assert tokens[-1] in tokenizer.eos_token_ids, tokenizer.decode(tokens)
        jsonschema.validate(json.loads(tokenizer.decode(tokens[:-1])), PERSON)

    alone = run(engine, {"held": held}, ids, 80)  # one row: its next step replayed ahead
    check(alone["held"])
    # Beside a free row, greedy and sampled (batches of 2 and 3 replay graphs too).
    sampled = SamplingParams(seed=1, grammar=grammar)
    mixed = run(engine, {"free": free, "held": held, "sampled": sampled}, ids, 80)
    check(mixed["held"])
    check(mixed["sampled"])
    with pytest.raises(ValueError):  # the free row is not held: it writes prose
        json.loads(tokenizer.decode(mixed["free"]))
