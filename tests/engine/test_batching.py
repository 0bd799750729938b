"""A batch of sequences of different lengths gives each sequence what it gets alone."""

from __future__ import annotations

import torch

from engine.batch import SeqInput
from engine.engine import Engine
from engine.sampling_params import SamplingParams


def greedy_alone(engine: Engine, prompt: list[int], table: list[int], steps: int) -> list[int]:
    out = engine.step([SeqInput("alone", prompt, 0, table)])
    tokens = [out[0].token_id]
    for pos in range(len(prompt), len(prompt) + steps - 1):
        out = engine.step([SeqInput("alone", [tokens[-1]], pos, table)])
        tokens.append(out[0].token_id)
    return tokens


def test_mixed_batch_equals_each_sequence_alone(tiny_engine: Engine) -> None:
    gen = torch.Generator().manual_seed(2)
    vocab = tiny_engine.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 17, 1, 30)]
    tables = [list(range(i * 12, i * 12 + 12)) for i in range(4)]
    steps = 8
    expected = [greedy_alone(tiny_engine, p, tables[i], steps) for i, p in enumerate(prompts)]

    # Staggered admission: sequences 0 and 1 prefill first, 2 and 3 join while 0 and 1 decode,
    # so steps mix whole prefills, and decodes of different context lengths.
    tokens: dict[int, list[int]] = {i: [] for i in range(4)}
    pos = {i: 0 for i in range(4)}
    joined = {0: 0, 1: 0, 2: 2, 3: 3}
    for step in range(steps + 3):
        batch = []
        for i, prompt in enumerate(prompts):
            if step < joined[i] or len(tokens[i]) >= steps:
                continue
            new = prompt if not tokens[i] else [tokens[i][-1]]
            batch.append(SeqInput(f"s{i}", new, pos[i], tables[i]))
        for out in tiny_engine.step(batch):
            i = int(out.seq_id[1:])
            pos[i] += len(prompts[i]) if not tokens[i] else 1
            tokens[i].append(out.token_id)
    assert [tokens[i] for i in range(4)] == expected


def test_chunked_prefill_in_a_batch_with_decodes(tiny_engine: Engine) -> None:
    gen = torch.Generator().manual_seed(3)
    vocab = tiny_engine.config.vocab_size
    long_prompt = torch.randint(0, vocab, (25,), generator=gen).tolist()
    short_prompt = torch.randint(0, vocab, (6,), generator=gen).tolist()
    long_table, short_table = list(range(20, 30)), list(range(40, 44))
    expected_long = greedy_alone(tiny_engine, long_prompt, long_table, 3)
    expected_short = greedy_alone(tiny_engine, short_prompt, short_table, 4)

    out = tiny_engine.step([SeqInput("short", short_prompt, 0, short_table)])
    short = [out[0].token_id]
    long: list[int] = []
    chunks = [(0, 10), (10, 20), (20, 25)]
    for start, end in chunks:
        batch = [
            SeqInput("long", long_prompt[start:end], start, long_table, sample=end == 25),
            SeqInput("short", [short[-1]], len(short_prompt) + len(short) - 1, short_table),
        ]
        for o in tiny_engine.step(batch):
            (long if o.seq_id == "long" else short).append(o.token_id)
    assert short == expected_short
    assert long == expected_long[:1]


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(tiny_engine: Engine) -> None:
    vocab = tiny_engine.config.vocab_size
    prompt = list(range(3, 15))
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = tiny_engine.step([SeqInput("x", prompt, 0, [0, 1, 2, 3], seeded)])[0].token_id
    others = [
        SeqInput(
            f"o{i}",
            [(7 * i) % vocab] * (i + 2),
            0,
            [10 + i * 3, 11 + i * 3, 12 + i * 3],
            SamplingParams(temperature=1.0),
        )
        for i in range(3)
    ]
    batch = [others[0], SeqInput("x", prompt, 0, [0, 1, 2, 3], seeded), *others[1:]]
    together = {o.seq_id: o.token_id for o in tiny_engine.step(batch)}
    assert together["x"] == alone
