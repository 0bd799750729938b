"""Guided decoding: formats compiled against the default model's vocabulary, masks that follow
the tokens sampled, and whole generations of the default model held to a schema, a regex and
a choice (each checked by a parser that is not llguidance)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import llguidance
import numpy as np
import pytest
import torch
from llguidance.numpy import fill_next_token_bitmask

from engine.batch import FROM_LAST_STEP, SeqInput
from engine.engine import Engine
from engine.errors import InvalidRequest
from engine.guided import Guides, OutputFormat, _Vocabulary, compile_format, grammar_tokenizer
from engine.sampling import Sampler
from engine.sampling_params import MAX_GRAMMAR_BYTES, SamplingParams
from engine.tokenizer import Llama3Tokenizer, Tokenizer, load_tokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(default_gguf: Path) -> Tokenizer:
    return load_tokenizer(default_gguf)


@pytest.fixture(scope="module")
def compile_(tokenizer: Tokenizer) -> Callable[[OutputFormat], str]:
    vocabulary = grammar_tokenizer(tokenizer, tokenizer.vocab_size)
    return lambda fmt: compile_format(fmt, vocabulary)


@pytest.fixture(scope="module")
def engine(default_gguf: Path) -> Engine:
    return Engine.from_path(default_gguf, kv_cache_bytes=32 << 20, progress=False)


def allowed(guides: Guides, grammar: str, output: list[int], seq_id: str = "s") -> set[int]:
    (mask,) = guides.masks([seq_id], [grammar], [output])
    bits = (torch.from_numpy(mask)[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return set(torch.nonzero(bits.reshape(-1)).flatten().tolist())


@pytest.mark.parametrize(
    ("fmt", "message"),
    [
        (OutputFormat("json_schema", "{not json", "f"), "f: is not JSON"),
        (OutputFormat("json_schema", "[1, 2]", "f"), "f: a JSON schema is an object, not list"),
        (OutputFormat("json_schema", '{"type": "colour"}', "f"), "f: .*colour"),
        (OutputFormat("json_schema", '{"$ref": "#/nowhere"}', "f"), "f: .*nowhere"),
        (OutputFormat("regex", "(", "f"), "f: .*unclosed group"),
        (OutputFormat("regex", "", "f"), "f: is empty"),
        (OutputFormat("choice", (), "f"), "f: give 1 to 256 choices, not 0"),
        (OutputFormat("choice", ("a", ""), "f"), "f: a choice is empty"),
        (OutputFormat("grammar", " \n", "f"), "f: is empty"),
        (OutputFormat("grammar", "start: ((", "f"), "f: .*Expected token"),
        (OutputFormat("grammar", "start: a_rule", "f"), "f: .*unknown name"),
        (OutputFormat("grammar", "root ::= (((", "f"), "f: is neither Lark nor GBNF"),
    ],
)
def test_a_bad_format_is_refused_naming_its_field(
    compile_: Callable[[OutputFormat], str], fmt: OutputFormat, message: str
) -> None:
    with pytest.raises(InvalidRequest, match=message):
        compile_(fmt)


def test_a_format_too_large_to_travel_is_refused(compile_: Callable[[OutputFormat], str]) -> None:
    schema = {"enum": [f"value number {i}" for i in range(2000)]}
    with pytest.raises(InvalidRequest, match=f"at most {MAX_GRAMMAR_BYTES:,}"):
        compile_(OutputFormat("json_schema", json.dumps(schema), "f"))


def test_min_tokens_cannot_hold_back_the_end_of_a_grammar() -> None:
    with pytest.raises(InvalidRequest, match="min_tokens"):
        SamplingParams(grammar="x", min_tokens=2)


def test_masks_follow_the_tokens_sampled(
    tokenizer: Tokenizer, compile_: Callable[[OutputFormat], str]
) -> None:
    grammar = compile_(OutputFormat("choice", ("yes", "no")))
    guides = Guides(lambda: tokenizer, tokenizer.vocab_size)
    first = allowed(guides, grammar, [])
    assert first, "something must be allowed at the start"
    assert all(
        ("yes".startswith(t) or "no".startswith(t)) for t in (tokenizer.decode([i]) for i in first)
    )
    (yes,) = tokenizer.encode("yes", allow_special=False)
    assert yes in first
    # After "yes" the text is complete: only the end-of-sequence ids may follow.
    assert allowed(guides, grammar, [yes]) == set(tokenizer.eos_token_ids)


def test_a_sequence_resumed_shorter_is_followed_again_from_its_start(
    tokenizer: Tokenizer, compile_: Callable[[OutputFormat], str]
) -> None:
    grammar = compile_(OutputFormat("regex", "ab|ac"))
    guides = Guides(lambda: tokenizer, tokenizer.vocab_size)
    (a,) = tokenizer.encode("a", allow_special=False)
    (b,) = tokenizer.encode("b", allow_special=False)
    assert allowed(guides, grammar, [a, b]) == set(tokenizer.eos_token_ids)
    # Recomputed after a preemption, with one output token fewer: "a" allows b or c again.
    after_a = allowed(guides, grammar, [a])
    assert b in after_a and tokenizer.encode("c", allow_special=False)[0] in after_a


def test_a_released_sequence_starts_afresh(
    tokenizer: Tokenizer, compile_: Callable[[OutputFormat], str]
) -> None:
    grammar = compile_(OutputFormat("choice", ("yes", "no")))
    guides = Guides(lambda: tokenizer, tokenizer.vocab_size)
    (yes,) = tokenizer.encode("yes", allow_special=False)
    start = allowed(guides, grammar, [])
    allowed(guides, grammar, [yes])
    guides.release("s")
    assert allowed(guides, grammar, []) == start


@pytest.fixture(scope="module")
def llama3(llama3_tokenizer_model: Path) -> Tokenizer:
    return Llama3Tokenizer(llama3_tokenizer_model)


@pytest.mark.parametrize(
    ("vocabulary", "special"), [("default", "<|im_end|>"), ("llama3", "<|eot_id|>")]
)
def test_special_text_a_grammar_forces_is_spelled_in_ordinary_tokens(
    vocabulary: str, special: str, tokenizer: Tokenizer, llama3: Tokenizer
) -> None:
    """Text that reads as an end token is text: were the token allowed, the sequence would end
    inside its form. The default vocabulary is tokenized through Python, LLaMA-3's natively."""
    vocab = tokenizer if vocabulary == "default" else llama3
    grammar = compile_format(
        OutputFormat("regex", "x" + re.escape(special) + "y"),
        grammar_tokenizer(vocab, vocab.vocab_size),
    )
    guides = Guides(lambda: vocab, vocab.vocab_size)
    ids = vocab.encode("x" + special + "y", allow_special=False)
    for n in range(len(ids)):
        step = allowed(guides, grammar, ids[:n])
        assert ids[n] in step and not step & vocab.special_ids, vocab.decode(ids[:n])
    assert allowed(guides, grammar, ids) == set(vocab.eos_token_ids)


def test_the_llama3_vocabulary_read_natively_gives_the_masks_of_our_tokenizer(
    llama3: Tokenizer,
) -> None:
    """llguidance reads tiktoken's ranks itself; the same masks as when it calls our encoder."""
    native = grammar_tokenizer(llama3, llama3.vocab_size)
    through_python = llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(_Vocabulary(llama3)),
        n_vocab=llama3.vocab_size,
        eos_token=sorted(llama3.eos_token_ids),
    )
    grammar = compile_format(OutputFormat("json_schema", json.dumps(PERSON)), native)
    ids = llama3.encode('{"name": "Zoë  x", "age": 30, "pets": ["cat"]}', allow_special=False)
    masks = []
    for vocabulary in (native, through_python):
        matcher = llguidance.LLMatcher(vocabulary, grammar)
        steps = np.zeros((len(ids) + 1, (llama3.vocab_size + 31) // 32), dtype=np.int32)
        for n, token in enumerate([*ids, None]):
            fill_next_token_bitmask(matcher, steps, n)
            if token is not None:
                assert matcher.consume_token(token), llama3.decode(ids[: n + 1])
        masks.append(steps)
    assert (masks[0] == masks[1]).all() and len({m.tobytes() for m in masks[0]}) > 5


@pytest.mark.parametrize("vocabulary", ["default", "llama3"])
def test_a_large_batchs_masks_equal_each_rows_own(
    vocabulary: str, tokenizer: Tokenizer, llama3: Tokenizer
) -> None:
    """From 8 rows the masks are computed on llguidance's threads where it encodes text itself
    (LLaMA-3's vocabulary), and in a loop where that calls back into Python: the same masks."""
    vocab = tokenizer if vocabulary == "default" else llama3
    grammar = compile_format(
        OutputFormat("json_schema", json.dumps(PERSON)), grammar_tokenizer(vocab, vocab.vocab_size)
    )
    text = '{"name": "Ann", "age": 30, "pets": ["cat", "dog"]}'
    ids = vocab.encode(text, allow_special=False)
    outputs = [ids[:n] for n in range(0, len(ids), max(1, len(ids) // 12))][:12]
    together = Guides(lambda: vocab, vocab.vocab_size, threads=2)
    batch = together.masks(
        [f"s{r}" for r in range(len(outputs))], [grammar] * len(outputs), outputs
    )
    assert together._parallel == (vocabulary == "llama3")
    alone = Guides(lambda: vocab, vocab.vocab_size, threads=1)
    rows = [alone.masks([f"s{r}"], [grammar], [out])[0] for r, out in enumerate(outputs)]
    assert len(outputs) >= 8 and (batch == rows).all()
    assert len({row.tobytes() for row in rows}) > 3  # states that differ, not one mask 12 times


def test_the_sampler_picks_only_allowed_tokens() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0], [5.0, 4.0, 3.0, 2.0]])
    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=2.0, seed=7)
    only = torch.tensor([[False, False, True, True]])
    out = Sampler()(logits, [greedy, greedy], [0, 0], [None, None], None, ([1], only))
    assert out.token_ids.tolist() == [0, 2]  # row 0 is free
    picks = {
        Sampler()(logits, [sampled] * 2, [p, p], [None] * 2, None, ([1], only)).token_ids[1].item()
        for p in range(40)
    }
    assert picks == {2, 3}
    # The logprob reported is the model's own, not the masked distribution's.
    out = Sampler()(logits, [greedy, greedy], [0, 0], [None, None], None, ([1], only))
    assert out.logprobs[1].item() == pytest.approx((3.0 - torch.logsumexp(logits[1], 0)).item())


def generate(engine: Engine, ids: list[int], params: SamplingParams, steps: int = 96) -> list[int]:
    """The engine's tokens for one sequence, submitted the way the worker does (each decode
    takes the token of the step still running) until an end-of-sequence id."""
    eos = engine.guides.tokenizer.eos_tokens if engine.guides else []
    table = list(range(-(-(len(ids) + steps) // engine.block_size)))
    seq = SeqInput("g", ids, 0, table, params, prompt_len=len(ids))
    out: list[int] = []
    for i in range(steps):
        (o,) = engine.step([seq])
        out.append(o.token_id)
        if o.token_id in eos:
            break
        seq = SeqInput("g", [FROM_LAST_STEP], len(ids) + i, table, params, prompt_len=len(ids))
    engine.release(["g"])
    return out


def chat(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode_chat([{"role": "user", "content": text}])


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_default_model_writes_json_its_schema_accepts(
    engine: Engine,
    tokenizer: Tokenizer,
    compile_: Callable[[OutputFormat], str],
    temperature: float,
) -> None:
    grammar = compile_(OutputFormat("json_schema", json.dumps(PERSON)))
    params = SamplingParams(temperature=temperature, seed=3, grammar=grammar)
    ids = chat(tokenizer, "Describe a person called Ann as JSON.")
    out = generate(engine, ids, params)
    assert out[-1] in tokenizer.eos_token_ids, "the object must be complete before the end"
    person = json.loads(tokenizer.decode(out[:-1]))
    assert set(person) == {"name", "age", "pets"}
    assert isinstance(person["name"], str) and len(person["name"]) <= 20
    assert isinstance(person["age"], int) and 0 <= person["age"] <= 150
    assert all(p in ("cat", "dog") for p in person["pets"]) and len(person["pets"]) <= 3
    # Free, the same prompt does not answer in this form: the grammar is what held it.
    free = generate(engine, ids, SamplingParams(temperature=0), steps=40)
    with pytest.raises(ValueError):
        json.loads(tokenizer.decode(free))


@pytest.mark.slow
def test_the_default_model_keeps_to_a_regex_and_a_choice(
    engine: Engine, tokenizer: Tokenizer, compile_: Callable[[OutputFormat], str]
) -> None:
    date = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
    out = generate(
        engine,
        chat(tokenizer, "When did the first person walk on the moon?"),
        SamplingParams(temperature=0, grammar=compile_(OutputFormat("regex", date))),
    )
    assert re.fullmatch(date, tokenizer.decode(out[:-1])), tokenizer.decode(out)
    choices = ("Paris", "London", "a city (unknown)")
    out = generate(
        engine,
        chat(tokenizer, "What is the capital of France?"),
        SamplingParams(temperature=1.0, seed=1, grammar=compile_(OutputFormat("choice", choices))),
    )
    assert tokenizer.decode(out[:-1]) in choices


@pytest.mark.parametrize(
    "grammar",
    [
        'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"',  # Lark
        'root ::= "The answer is " answer "."\nanswer ::= "yes" | "no"',  # GBNF
    ],
)
def test_the_default_model_keeps_to_a_grammar(
    engine: Engine, tokenizer: Tokenizer, compile_: Callable[[OutputFormat], str], grammar: str
) -> None:
    out = generate(
        engine,
        chat(tokenizer, "Is the sky blue?"),
        SamplingParams(temperature=0, grammar=compile_(OutputFormat("grammar", grammar))),
    )
    assert tokenizer.decode(out[:-1]) in ("The answer is yes.", "The answer is no.")


@pytest.mark.slow
def test_constrained_and_free_sequences_share_a_step(
    engine: Engine, tokenizer: Tokenizer, compile_: Callable[[OutputFormat], str]
) -> None:
    ids = chat(tokenizer, "What is the capital of France?")
    free = generate(engine, ids, SamplingParams(temperature=0), steps=12)
    grammar = compile_(OutputFormat("choice", ("Paris", "Lyon")))
    table_a = list(range(0, 8))
    table_b = list(range(8, 16))
    held = SamplingParams(temperature=0, grammar=grammar)
    batch = [
        SeqInput("a", ids, 0, table_a, SamplingParams(temperature=0), prompt_len=len(ids)),
        SeqInput("b", ids, 0, table_b, held, prompt_len=len(ids)),
    ]
    outs: dict[str, list[int]] = {"a": [], "b": []}
    for i in range(12):
        for o in engine.step(batch):
            outs[str(o.seq_id)].append(o.token_id)
        batch = [
            SeqInput(s, [FROM_LAST_STEP], len(ids) + i, t, p, prompt_len=len(ids))
            for s, t, p in (("a", table_a, SamplingParams(temperature=0)), ("b", table_b, held))
            if outs[s][-1] not in tokenizer.eos_token_ids
        ]
        if not batch:
            break
    engine.release(["a", "b"])
    assert outs["a"] == free[: len(outs["a"])]
    assert tokenizer.decode(outs["b"][:-1]) in ("Paris", "Lyon")


def test_an_engine_without_a_tokenizer_refuses_a_grammar(engine: Engine) -> None:
    bare = Engine(engine.loaded, num_kv_blocks=8)
    with pytest.raises(InvalidRequest, match="output_format: this engine has no tokenizer"):
        bare.check_sampling(SamplingParams(grammar="{}"))


def test_an_engine_refuses_a_grammar_that_does_not_compile(engine: Engine) -> None:
    with pytest.raises(InvalidRequest, match="output_format"):
        engine.check_sampling(SamplingParams(grammar='{"grammars": [{"nonsense": 1}]}'))


@pytest.mark.slow
def test_a_tensor_parallel_group_holds_output_to_a_grammar(
    default_gguf: Path, tokenizer: Tokenizer, compile_: Callable[[OutputFormat], str]
) -> None:
    """Rank 0 follows the grammar; the other rank, whose samples are dropped, steps without."""
    from engine.rank_group import EngineArgs, start_engine

    args = EngineArgs(default_gguf, kv_cache_bytes=16 << 20, progress=False, max_num_seqs=4)
    group = start_engine(args, 2)
    try:
        params = SamplingParams(
            temperature=0, grammar=compile_(OutputFormat("choice", ("yes", "no")))
        )
        ids = chat(tokenizer, "Is the sky blue?")
        table = list(range(-(-(len(ids) + 8) // group.block_size)))
        out = [group.step([SeqInput("t", ids, 0, table, params, prompt_len=len(ids))])[0].token_id]
        while out[-1] not in tokenizer.eos_token_ids and len(out) < 8:
            seq = SeqInput(
                "t", [out[-1]], len(ids) + len(out) - 1, table, params, prompt_len=len(ids)
            )
            out.append(group.step([seq])[0].token_id)
        assert tokenizer.decode(out[:-1]) in ("yes", "no") and out[-1] in tokenizer.eos_token_ids
    finally:
        group.close()
