"""The requests a run sends and when: a replayable sequence drawn from the seed."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import count

from services.bench.config import BenchConfig
from services.bench.prompts import CHAT_PROMPTS, WORDS


@dataclass(frozen=True)
class RequestSpec:
    index: int  # position in the run, warm-up requests first
    text: str  # the prompt, or the user message when `chat`
    chat: bool  # sent as one user message, rendered with the server's chat template
    max_tokens: int
    priority: int
    prompt_words: int  # the intended prompt length in tokens for the sized text; 0 for chat

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.text}]


def requests(config: BenchConfig) -> Iterator[RequestSpec]:
    """An endless sequence; every call replays the same one, so each target gets equal work."""
    # One stream per choice, so adding a priority mix does not change the prompts.
    prompt_rng = random.Random(f"{config.seed}:prompt")
    length_rng = random.Random(f"{config.seed}:length")
    priority_rng = random.Random(f"{config.seed}:priority")
    priorities = [p for p, _ in config.priority_mix]
    weights = [w for _, w in config.priority_mix]
    for index in count():
        max_tokens = draw_length(length_rng, config.output_len, config.random_range)
        if config.dataset == "chat":
            text, words = prompt_rng.choice(CHAT_PROMPTS), 0
        else:
            words = draw_length(length_rng, config.prompt_len, config.random_range)
            # Random words rather than one repeated passage: no two prompts share a long prefix,
            # so a prefix cache cannot turn the benchmark's prefills into cache hits.
            text = " ".join(prompt_rng.choice(WORDS) for _ in range(words))
        priority = priorities[0]
        if len(priorities) > 1:
            priority = priority_rng.choices(priorities, weights)[0]
        yield RequestSpec(index, text, config.chat_prompts, max_tokens, priority, words)


def draw_length(rng: random.Random, n: int, ratio: float) -> int:
    if ratio == 0:
        return n
    return rng.randint(max(1, round(n * (1 - ratio))), max(1, round(n * (1 + ratio))))


def arrival_gaps(rate: float, seed: int) -> Iterator[float]:
    """Seconds between Poisson arrivals at `rate` per second."""
    rng = random.Random(f"{seed}:arrival")
    while True:
        yield rng.expovariate(rate)
