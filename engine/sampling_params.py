"""What a request asks of sampling: validated once, shared by the engine, the services and the
CLI without importing torch."""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.errors import InvalidRequest

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # entries of one request's logit_bias
MAX_ALLOWED_TOKEN_IDS = 1024  # they travel in the step that starts the sequence, as a grammar
MAX_BAD_WORDS_IDS = 1024  # the tokens of all of a request's bad words, for the same reason
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: a bias is in [-100, 100]
# A grammar travels with its request through the scheduler to the worker, in the step that
# starts the sequence: a step starting max_num_seqs sequences must stay well inside a ring record.
MAX_GRAMMAR_BYTES = 16 << 10


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 → greedy
    top_k: int = 0  # 0 → off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF semantics, over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI semantics, over output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int = 0  # how many top alternatives to return with each token
    # (token id, what is added to its logit) pairs, as OpenAI's logit_bias; before temperature.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # stop_token_ids cannot be sampled before this many output tokens (vLLM's min_tokens).
    min_tokens: int = 0
    # The ids that end the sequence (end-of-sequence and the request's own): what min_tokens
    # holds back. Unused without min_tokens.
    stop_token_ids: tuple[int, ...] = ()
    # What the output is held to (engine/guided.py compiles it; "" is free text).
    grammar: str = ""
    # Score the prompt too: each prompt token's logprob and rank given the tokens before it,
    # with this many top alternatives (vLLM's prompt_logprobs). None: the prompt is not scored.
    prompt_logprobs: int | None = None
    # Only these ids may be sampled (vLLM's allowed_token_ids); empty: any.
    allowed_token_ids: tuple[int, ...] = ()
    # Token sequences the output may not complete (vLLM's bad_words, tokenized): a sequence's
    # last token is masked where the output so far ends with the rest of it.
    bad_words_ids: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        checks = (
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0, ">= 0"),
            ("top_k", self.top_k >= 0, ">= 0 (0 turns it off)"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("repetition_penalty", 0 < self.repetition_penalty <= 10, "in (0, 10]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            ("logprobs", 0 <= self.logprobs <= MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]"),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                f"in [0, {MAX_LOGPROBS}]",
            ),
            ("seed", self.seed is None or 0 <= self.seed < 2**63, "in [0, 2**63)"),
            ("min_tokens", self.min_tokens >= 0, ">= 0"),
            ("logit_bias", len(self.logit_bias) <= MAX_LOGIT_BIAS, f"at most {MAX_LOGIT_BIAS} ids"),
            (
                "grammar",
                len(self.grammar.encode()) <= MAX_GRAMMAR_BYTES,
                f"at most {MAX_GRAMMAR_BYTES} bytes",
            ),
            # Once a form is complete only an end token may follow, which min_tokens would mask.
            ("min_tokens", not (self.grammar and self.min_tokens), "0 with an output format"),
            (
                "allowed_token_ids",
                len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS,
                f"at most {MAX_ALLOWED_TOKEN_IDS} ids",
            ),
            # A form's own mask could leave a row nothing to take.
            (
                "allowed_token_ids",
                not (self.grammar and self.allowed_token_ids),
                "empty with an output format",
            ),
            # Nor may min_tokens hold back every one of them.
            (
                "allowed_token_ids",
                not (self.min_tokens and set(self.allowed_token_ids) <= set(self.stop_token_ids))
                or not self.allowed_token_ids,
                "more than ids that end the sequence, which min_tokens holds back",
            ),
            (
                "bad_words_ids",
                sum(map(len, self.bad_words_ids)) <= MAX_BAD_WORDS_IDS and all(self.bad_words_ids),
                f"non-empty sequences of at most {MAX_BAD_WORDS_IDS} ids in all",
            ),
            (
                "bad_words_ids",
                not (self.bad_words_ids and (self.grammar or self.allowed_token_ids)),
                "empty with an output format or allowed_token_ids",
            ),
        )
        for field, ok, rule in checks:
            if not ok:
                value = getattr(self, field)
                sized = field in ("logit_bias", "grammar", "allowed_token_ids", "bad_words_ids")
                got = f"{len(value)}" if sized else repr(value)  # not the map or the text
                raise InvalidRequest(field, f"must be {rule}, got {got}")
        for token_id, bias in self.logit_bias:
            if token_id < 0 or not (math.isfinite(bias) and abs(bias) <= LOGIT_BIAS_RANGE):
                raise InvalidRequest(
                    "logit_bias",
                    f"{token_id}: {bias} must be a token id >= 0 with a bias in "
                    f"[-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]",
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        penalties = (self.repetition_penalty, self.presence_penalty, self.frequency_penalty)
        return penalties != (1.0, 0.0, 0.0)

    @property
    def needs_history(self) -> bool:
        """Whether sampling reads the sequence's tokens so far (penalties count them, a grammar
        follows them), so the engine keeps them on the host."""
        return (
            self.uses_penalties
            or bool(self.grammar)
            or any(len(word) > 1 for word in self.bad_words_ids)
        )

    @property
    def adjusts_logits(self) -> bool:
        """Whether the model's logits are changed before the pick (so greedy is not argmax)."""
        return (
            self.uses_penalties
            or bool(self.logit_bias)
            or bool(self.allowed_token_ids)
            or bool(self.bad_words_ids)
            or self.min_tokens > 0
            or bool(self.grammar)
        )


GREEDY = SamplingParams(temperature=0.0)
