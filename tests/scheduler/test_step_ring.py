"""The step ring holds a step that starts as many sequences as a step may, each carrying a
grammar of the largest size: a record too large for the ring would lose the worker."""

from __future__ import annotations

import pytest

from engine.sampling_params import MAX_GRAMMAR_BYTES
from services.protocol import SequenceRecord, StepPlan, encode_plan
from services.scheduler.worker_link import STEP_RING_BYTES, step_ring_bytes
from shm.producer import RingProducer
from tandem.internal.v1 import hotpath_pb2 as hp


@pytest.mark.parametrize("max_num_seqs", [1, 256, 1024])
def test_a_step_starting_every_sequence_with_the_largest_grammar_fits_the_ring(
    max_num_seqs: int,
) -> None:
    grammar = "g" * MAX_GRAMMAR_BYTES
    plan = StepPlan(step_id=1)
    records = {}
    for seq_id in range(max_num_seqs):
        plan.seq_ids.append(seq_id)
        plan.token_ids.append(7)
        plan.num_tokens.append(1)
        plan.start_pos.append(0)
        plan.block_tables.append((seq_id,))
        plan.sample.append(True)
        # Distinct grammars: nothing in a step is shared between its sequences.
        plan.new_sampling[seq_id] = hp.Sampling(
            temperature=1.0, grammar=grammar[:-6] + f"{seq_id:06d}"
        )
        records[seq_id] = SequenceRecord(seq_id, 1, b"h" * 64, [], traceparent="t" * 55)
    record = encode_plan(plan, records).SerializeToString()
    ring = RingProducer.create(step_ring_bytes(max_num_seqs))
    try:
        assert len(record) <= ring.max_payload
        ring.put(record, timeout=1.0)
    finally:
        ring.close()
    assert step_ring_bytes(256) == STEP_RING_BYTES  # the default settings keep the size they had
