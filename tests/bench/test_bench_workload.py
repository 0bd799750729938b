"""The workload: replayable from the seed, sized as asked, and equal token counts everywhere."""

from __future__ import annotations

from collections import Counter
from itertools import islice
from pathlib import Path

import pytest

from engine.tokenizer import load_tokenizer
from services.bench.config import BenchConfig, BenchConfigError, Target, parse_priority_mix
from services.bench.prompts import CHAT_PROMPTS, WORDS
from services.bench.workload import RequestSpec, arrival_gaps, requests

TANDEM = Target("tandem", "127.0.0.1:1")
OPENAI = Target("openai", "http://127.0.0.1:1")


def first(n: int, **overrides: object) -> list[RequestSpec]:
    config = BenchConfig(targets=(TANDEM,), **overrides)  # type: ignore[arg-type]
    return list(islice(requests(config), n))


def test_the_same_seed_replays_the_same_requests_and_another_does_not() -> None:
    assert first(20, random_range=0.5) == first(20, random_range=0.5)
    assert first(20, random_range=0.5) != first(20, random_range=0.5, seed=1)
    texts = [s.text for s in first(20)]
    assert len(set(texts)) == 20  # no shared prompts for a prefix cache to hit


def test_fixed_and_random_lengths() -> None:
    fixed = first(10, prompt_len=32, output_len=8)
    assert {(s.prompt_words, len(s.text.split()), s.max_tokens) for s in fixed} == {(32, 32, 8)}
    drawn = first(200, prompt_len=100, output_len=50, random_range=0.2)
    assert {s.prompt_words for s in drawn} <= set(range(80, 121))
    assert {s.max_tokens for s in drawn} <= set(range(40, 61))
    assert len({s.prompt_words for s in drawn}) > 10
    assert all(len(s.text.split()) == s.prompt_words for s in drawn)


def test_the_priority_mix_follows_its_weights_without_changing_the_prompts() -> None:
    mixed = first(2000, priority_mix=((0, 0.9), (10, 0.1)))
    share = Counter(s.priority for s in mixed)[10] / len(mixed)
    assert 0.06 < share < 0.14
    assert [s.text for s in mixed[:20]] == [s.text for s in first(20)]


def test_chat_dataset_and_chat_endpoint_use_the_chat_template() -> None:
    chat = first(30, dataset="chat")
    assert all(s.chat and s.text in CHAT_PROMPTS and s.prompt_words == 0 for s in chat)
    assert chat[0].messages() == [{"role": "user", "content": chat[0].text}]
    config = BenchConfig(targets=(TANDEM, OPENAI), endpoint="chat")
    assert next(requests(config)).chat


def test_poisson_gaps_average_one_over_the_rate() -> None:
    gaps = list(islice(arrival_gaps(4.0, seed=0), 4000))
    assert 0.23 < sum(gaps) / len(gaps) < 0.27
    assert gaps[:5] == list(islice(arrival_gaps(4.0, seed=0), 5))


def test_prompt_words_are_one_token_each_in_the_default_model(default_gguf: Path) -> None:
    tokenizer = load_tokenizer(default_gguf)
    for word in WORDS:
        assert len(tokenizer.encode(word, allow_special=False)) == 1, word
        assert len(tokenizer.encode(" " + word, allow_special=False)) == 1, word
    for spec in first(5, prompt_len=200, random_range=0.5):
        assert len(tokenizer.encode(spec.text, allow_special=False)) == spec.prompt_words


@pytest.mark.parametrize(
    ("overrides", "complaint"),
    [
        ({"targets": ()}, "at least one"),
        ({"targets": (OPENAI,), "dataset": "chat"}, "--endpoint chat"),
        ({"targets": (OPENAI,), "priority_mix": ((0, 1.0), (1, 1.0))}, "tandem targets only"),
        ({"duration": 5.0, "num_requests": 5}, "not both"),
        ({"random_range": 1.0}, "--random-range"),
        ({"rate": 0.0}, "--rate"),
        ({"concurrency": 0}, "--concurrency"),
        ({"prompt_len": 0}, "--prompt-len"),
        ({"warmup": -1}, "--warmup"),
    ],
)
def test_bad_configs_name_the_flag(overrides: dict[str, object], complaint: str) -> None:
    args: dict[str, object] = {"targets": (TANDEM,), **overrides}
    with pytest.raises(BenchConfigError, match=complaint):
        BenchConfig(**args)  # type: ignore[arg-type]


def test_targets_check_their_url() -> None:
    with pytest.raises(BenchConfigError, match="http://HOST:PORT"):
        Target("openai", "127.0.0.1:8080")
    with pytest.raises(BenchConfigError, match="HOST:PORT"):
        Target("tandem", "http://127.0.0.1:50051")


def test_in_flight_cap_and_measured_count_defaults() -> None:
    assert BenchConfig(targets=(TANDEM,)).in_flight_cap == 1
    assert BenchConfig(targets=(TANDEM,), rate=2.0).in_flight_cap is None
    assert BenchConfig(targets=(TANDEM,), rate=2.0, concurrency=4).in_flight_cap == 4
    assert BenchConfig(targets=(TANDEM,)).measured_requests == 100
    assert BenchConfig(targets=(TANDEM,), duration=3.0).measured_requests is None


def test_parse_priority_mix() -> None:
    assert parse_priority_mix("0:0.9, 10:0.1") == ((0, 0.9), (10, 0.1))
    for bad in ("", "0", "a:1", "0:0", "0:1,0:2", "0:-1"):
        with pytest.raises(BenchConfigError):
            parse_priority_mix(bad)
