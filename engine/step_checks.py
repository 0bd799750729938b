"""The checks of a step's batch against the model and the KV pool, before anything runs: each bad
field raises InvalidRequest naming it, so a bad request fails alone and the engine goes on."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from engine.batch import FROM_LAST_STEP, SeqInput
from engine.errors import InvalidRequest


@dataclass
class StepChecks:  # not frozen: bench/serving.py's profile times decode_arrays in place
    vocab_size: int
    max_seq_len: int
    num_kv_blocks: int  # block ids a batch may name: [0, num_kv_blocks)
    block_size: int

    def validate(self, batch: Sequence[SeqInput], filled: bool = False) -> None:
        """filled: the batch's FROM_LAST_STEP tokens are put in place on the device (`Fill`)."""
        vocab = self.vocab_size
        lowest = FROM_LAST_STEP if filled else 0
        seen: set[Hashable] = set()
        for seq in batch:
            if seq.seq_id in seen:
                raise InvalidRequest("seq_id", f"{seq.seq_id} appears twice in one step")
            seen.add(seq.seq_id)
            if not seq.token_ids:
                raise InvalidRequest("token_ids", f"sequence {seq.seq_id} has no new tokens")
            if seq.start_pos < 0:
                raise InvalidRequest("start_pos", f"sequence {seq.seq_id}: must be >= 0")
            end = seq.start_pos + len(seq.token_ids)
            if end > self.max_seq_len:
                raise InvalidRequest(
                    "token_ids",
                    f"sequence {seq.seq_id} reaches position {end}, beyond the model's context "
                    f"of {self.max_seq_len}",
                )
            # min/max run in C: a step of hundreds of sequences checks in microseconds.
            if min(seq.token_ids) < lowest or max(seq.token_ids) >= vocab:
                raise InvalidRequest(
                    "token_ids", f"sequence {seq.seq_id} has ids outside [0, {vocab})"
                )
            table = seq.block_table
            if len(table) and (min(table) < 0 or max(table) >= self.num_kv_blocks):
                raise InvalidRequest(
                    "block_table", f"sequence {seq.seq_id} names blocks outside the pool"
                )
            if len(seq.block_table) * self.block_size < end:
                raise InvalidRequest(
                    "block_table",
                    f"sequence {seq.seq_id}: {len(seq.block_table)} blocks cannot hold {end} "
                    "positions",
                )

    def decode_arrays(self, batch: Sequence[SeqInput]) -> tuple[np.ndarray, np.ndarray] | None:
        """Tokens and positions (n,) of a batch of single-token decodes, checked as `validate`
        checks them but over arrays (a step of hundreds of rows is on the host's critical path);
        None where some row is not a decode. The loader of the graphs checks block ids."""
        n = len(batch)
        if any(len(s.token_ids) != 1 for s in batch):
            return None
        tokens = np.fromiter((s.token_ids[0] for s in batch), np.int64, n)
        positions = np.fromiter((s.start_pos for s in batch), np.int64, n)
        if positions.min() <= 0:  # a one-token prompt; or a bad position, which validate names
            self.validate(batch, filled=True)
            return None
        blocks = np.fromiter((len(s.block_table) for s in batch), np.int64, n)
        if not (
            tokens.min() >= FROM_LAST_STEP  # each FROM_LAST_STEP has its fill (Fill.of)
            and tokens.max() < self.vocab_size
            and positions.max() < self.max_seq_len
            and (blocks * self.block_size > positions).all()
            and len({s.seq_id for s in batch}) == n
        ):
            self.validate(batch, filled=True)  # raises, naming the field
        return tokens, positions
