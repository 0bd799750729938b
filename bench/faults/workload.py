"""Seeded requests for the campaigns: prompts of mixed lengths, priorities, stop strings."""

from __future__ import annotations

import random

from tandem.v1 import generation_pb2 as pb

_TALE = (
    "the river carried a small boat past old mills and green fields while children ran "
    "along the bank shouting names of birds they had never seen before the storm came"
)
_WORDS = tuple(_TALE.split(" "))
_TOPICS = ("a lighthouse", "the moon", "a clockmaker", "bread", "a desert road", "winter")
SHARED_PREFIX = "You are a careful assistant. Answer briefly and plainly. " * 3
STOPS = (".", "\n", " the", ",", "!")


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def long_stream(i: int) -> pb.GenerateRequest:
    """A stream that runs until it is killed or cancelled (thousands of tokens)."""
    return pb.GenerateRequest(
        text=f"Story number {i}:",
        max_tokens=4000,
        ignore_eos=True,
        sampling=pb.SamplingParams(temperature=0),
    )


def short(rng: random.Random, max_tokens: int = 24) -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        text=f"Write about {rng.choice(_TOPICS)}: {words(rng, rng.randint(3, 20))}",
        max_tokens=max_tokens,
        ignore_eos=True,
        sampling=pb.SamplingParams(temperature=0.8, seed=rng.getrandbits(32)),
    )
    return request


def long_prompt(rng: random.Random, n_words: int, max_tokens: int) -> pb.GenerateRequest:
    """A plain prompt of `n_words` words, greedy."""
    return pb.GenerateRequest(
        text=f"Summarize: {words(rng, n_words)}",
        max_tokens=max_tokens,
        ignore_eos=True,
        sampling=pb.SamplingParams(temperature=0),
    )


def mixed(rng: random.Random) -> pb.GenerateRequest:
    """The soak's request: text or chat, a shared system prefix or not, short to mid prompts,
    1 to 64 tokens, a priority, maybe stop strings, maybe sampling with penalties."""
    request = pb.GenerateRequest(
        max_tokens=rng.choice((1, 1, 2, 4, 4, 8, 8, 16, 32)),
        priority=rng.choice((0, 0, 0, 1, 5, -1)),
    )
    body = f"Tell me about {rng.choice(_TOPICS)}. {words(rng, rng.choice((2, 4, 8, 16, 30, 60)))}"
    if rng.random() < 0.5:
        request.chat.messages.add(role="system", content=SHARED_PREFIX)
        request.chat.messages.add(role="user", content=body)
    else:
        request.text = body
    if rng.random() < 0.3:
        request.stop.extend(rng.sample(STOPS, rng.randint(1, 3)))
    if rng.random() < 0.5:
        request.sampling.temperature = 0
    else:
        request.sampling.temperature = rng.choice((0.5, 1.0))
        request.sampling.top_p = rng.choice((0.9, 1.0))
        request.sampling.seed = rng.getrandbits(32)
        if rng.random() < 0.3:
            request.sampling.repetition_penalty = 1.2
            request.sampling.frequency_penalty = 0.3
    request.ignore_eos = rng.random() < 0.5
    if rng.random() < 0.1:
        request.logprobs = rng.randint(1, 5)
    return request
