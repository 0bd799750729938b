"""Per-sequence sampling for a whole batch at once, with no host sync before the step's `.tolist()`.

Seeded sampling is reproducible whatever else is in the batch: a sequence's random draw for the
token at position p comes from a counter-based hash of (seed, p, token id), not from a shared
generator whose state depends on the other rows. The draw is the exponential race (Gumbel-max):
argmax(probs / E) with E ~ Exp(1) picks a token with probability proportional to probs.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.errors import InvalidRequest
from engine.sampling_params import SamplingParams
from engine.upload import to_device


@dataclass
class SampledBatch:
    token_ids: torch.Tensor  # (S,) int64
    logprobs: torch.Tensor  # (S,) float32, of the sampled token under the model's distribution
    top_ids: torch.Tensor | None  # (S, n) int64 when any row asked for top-n
    top_logprobs: torch.Tensor | None  # (S, n) float32

    def packed(self) -> torch.Tensor:
        """(S, 2 + 2n) float64 rows: token, logprob, then the n top ids and their logprobs; one
        tensor, so the host gets it all in one transfer."""
        columns = [self.token_ids.double()[:, None], self.logprobs.double()[:, None]]
        if self.top_ids is not None and self.top_logprobs is not None:
            columns += [self.top_ids.double(), self.top_logprobs.double()]
        return torch.cat(columns, dim=1)

    @property
    def n_top(self) -> int:
        return self.top_ids.shape[1] if self.top_ids is not None else 0


# splitmix64 constants, as signed int64 so torch's wrapping arithmetic reproduces them.
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    # Logical right shift on int64: torch's >> is arithmetic, so mask the sign extension away.
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """(S, vocab) floats in (0, 1), a pure function of (seed, position, token id)."""
    idx = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    z = seeds[:, None] * _GOLDEN + positions[:, None] * _MIX2 + idx[None, :] * _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    return (_shr(z, 40).float() + 0.5) / float(1 << 24)


def completing(words: Sequence[Sequence[int]], history: tuple[list[int], int] | None) -> list[int]:
    """The tokens that would complete one of `words` after the output so far: each word's last
    token, where the output ends with the rest of it (a word of one token: always)."""
    output = history[0][history[1] :] if history is not None else []
    banned = set()
    for word in words:
        rest = len(word) - 1
        if rest == 0 or (len(output) >= rest and output[len(output) - rest :] == list(word[:rest])):
            banned.add(word[-1])
    return sorted(banned)


class Sampler:
    def __init__(self) -> None:
        self._rng = random.Random()

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        positions: Sequence[int],
        histories: Sequence[tuple[list[int], int] | None],
        prompt_lens: Sequence[int] | None = None,
        allowed: tuple[list[int], torch.Tensor] | None = None,
    ) -> SampledBatch:
        """logits: (S, V) fp32. positions[i]: where row i's token will go. histories[i]: the
        sequence's tokens so far and its prompt length, for rows with penalties (else None).
        prompt_lens[i]: row i's prompt length, for min_tokens (None: every row's is 0).
        allowed: rows held to a grammar, and (len(rows), V) bools of the tokens each may take."""
        device = logits.device
        raw = logits
        logits = self._apply_penalties(logits, params, histories)
        logits = self._apply_bias(logits, raw, params, positions, prompt_lens, histories)
        if allowed is not None:
            held, tokens = allowed
            if len(held) == logits.shape[0]:  # every row: no rows to pick out
                logits = logits.masked_fill(~tokens, float("-inf"))  # new: raw stays the model's
            else:
                index = to_device(held, device)
                kept = logits.index_select(0, index).masked_fill(~tokens, float("-inf"))
                logits = logits.index_copy(0, index, kept)
        chosen = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = to_device(random_rows, device)
            sub = [params[i] for i in random_rows]
            probs = self._filtered_probs(logits.index_select(0, rows), sub)
            seeds = [p.seed if p.seed is not None else self._rng.getrandbits(63) for p in sub]
            noise = uniform_noise(
                to_device(seeds, device),
                to_device([positions[i] for i in random_rows], device),
                logits.shape[-1],
            )
            picked = (probs / -torch.log(noise)).argmax(dim=-1)  # exponential race
            chosen = chosen.index_copy(0, rows, picked)
        # Logprobs under the model's own distribution: logit - logsumexp, without writing out
        # a whole (S, V) log-softmax unless alternatives were asked for.
        norm = torch.logsumexp(raw, dim=-1)  # (S,)
        logprobs = raw.gather(1, chosen[:, None])[:, 0] - norm
        n_top = max(p.logprobs for p in params)
        top_ids = top_lp = None
        if n_top:
            top_values, top_ids = raw.topk(n_top, dim=-1)
            top_lp = top_values - norm[:, None]
        return SampledBatch(chosen, logprobs, top_ids, top_lp)

    @staticmethod
    def _apply_penalties(
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        histories: Sequence[tuple[list[int], int] | None],
    ) -> torch.Tensor:
        rows = [i for i, p in enumerate(params) if p.uses_penalties]
        if not rows:
            return logits
        logits = logits.clone()
        device = logits.device
        for i in rows:
            history = histories[i]
            if history is None:
                raise ValueError(f"row {i} uses penalties but has no token history")
            tokens, prompt_len = history
            p = params[i]
            row = logits[i]
            # Which ids occur, and how often, counted on the host: on the device, unique and
            # bincount size their outputs by reading the data, which waits for the step.
            ids = np.asarray(tokens, dtype=np.int64)
            if p.repetition_penalty != 1.0 and len(tokens):
                seen = to_device(np.unique(ids), device)
                vals = row[seen]
                row[seen] = torch.where(
                    vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
                )
            output = ids[prompt_len:]
            if len(output) and (p.presence_penalty or p.frequency_penalty):
                present, counts = np.unique(output, return_counts=True)
                counts_t = to_device(counts.astype(np.float32), device)
                penalty = p.frequency_penalty * counts_t + p.presence_penalty
                row.index_add_(0, to_device(present, device), -penalty)
        return logits

    @staticmethod
    def _apply_bias(
        logits: torch.Tensor,
        raw: torch.Tensor,
        params: Sequence[SamplingParams],
        positions: Sequence[int],
        prompt_lens: Sequence[int] | None,
        histories: Sequence[tuple[list[int], int] | None],
    ) -> torch.Tensor:
        """logit_bias added; tokens other than allowed_token_ids, those that would complete a bad
        word, and stop tokens while a row has fewer than min_tokens, masked."""
        rows = [
            i
            for i, p in enumerate(params)
            if p.logit_bias or p.allowed_token_ids or p.bad_words_ids or p.min_tokens
        ]
        if not rows:
            return logits
        if logits is raw:
            logits = logits.clone()
        vocab, device = logits.shape[-1], logits.device
        for i in rows:
            p = params[i]
            if p.logit_bias:
                ids = [t for t, _ in p.logit_bias]
                if max(ids) >= vocab:
                    raise InvalidRequest("logit_bias", f"ids must be below the vocabulary {vocab}")
                bias = to_device(np.array([b for _, b in p.logit_bias], np.float32), device)
                logits[i].index_add_(0, to_device(ids, device), bias.to(logits.dtype))
            if p.allowed_token_ids:
                if max(p.allowed_token_ids) >= vocab:
                    raise InvalidRequest(
                        "allowed_token_ids", f"ids must be below the vocabulary {vocab}"
                    )
                keep = to_device(list(p.allowed_token_ids), device)
                kept = logits[i].index_select(0, keep)
                logits[i].fill_(float("-inf"))
                logits[i].index_copy_(0, keep, kept)
            if p.bad_words_ids and (banned := completing(p.bad_words_ids, histories[i])):
                if max(banned) >= vocab:
                    raise InvalidRequest("bad_words", f"ids must be below the vocabulary {vocab}")
                logits[i].index_fill_(0, to_device(banned, device), float("-inf"))
            produced = positions[i] - (prompt_lens[i] if prompt_lens is not None else 0)
            if produced < p.min_tokens:
                stops = [t for t in p.stop_token_ids if 0 <= t < vocab]
                if stops:
                    logits[i].index_fill_(0, to_device(stops, device), float("-inf"))
        return logits

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Temperature, then top-k, top-p and min-p, as renormalised probabilities (R, V)."""
        device = logits.device
        temps = to_device([p.temperature for p in params], device)[:, None]
        probs = torch.softmax(logits / temps, dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = to_device([p.min_p for p in params], device)[:, None]
            probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        if any(p.top_k > 0 or p.top_p < 1 for p in params):
            sorted_probs, order = probs.sort(dim=-1, descending=True)  # (R, V)
            vocab = probs.shape[-1]
            top_k = to_device([p.top_k or vocab for p in params], device)[:, None]
            ranks = torch.arange(vocab, device=device)[None, :]
            drop = ranks >= top_k
            top_p = to_device([p.top_p for p in params], device)[:, None]
            kept = sorted_probs.masked_fill(drop, 0.0)
            mass_before = kept.cumsum(dim=-1) - kept  # probability of the better-ranked tokens
            drop |= mass_before >= top_p * kept.sum(dim=-1, keepdim=True)
            drop[:, 0] = False  # the most likely token always stays
            probs = probs.scatter(1, order, sorted_probs.masked_fill(drop, 0.0))
        return probs / probs.sum(dim=-1, keepdim=True)
