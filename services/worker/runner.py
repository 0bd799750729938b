"""Running step descriptors through the engine: the worker's whole job, without transport."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

import numpy as np
import torch

from engine.batch import FROM_LAST_STEP, SeqInput
from engine.engine import Engine
from engine.errors import InvalidRequest, RankGroupError
from engine.prompt_scores import PromptLogprobs
from engine.sampling_params import SamplingParams
from engine.submitted import Submitted
from services.protocol import PLACEHOLDER, sampling_from_pb
from services.worker.telemetry import WorkerTelemetry
from services.worker.threads import ThreadPolicy
from shm.errors import ShmError
from shm.handle import Handle
from shm.reader import Reader
from tandem.internal.v1 import hotpath_pb2 as hp

log = logging.getLogger(__name__)
EXIT_RANK_GROUP_LOST = 3


def exit_group_lost(engine: Engine, why: object) -> NoReturn:
    """A rank of the group died: no step can run again. The worker exits at once, not at its next
    step, so the scheduler fails what was in flight and the launcher (or the container's restart
    policy) starts the worker, and with it the whole group, again."""
    log.critical("%s; the worker exits", why)
    engine.close()
    os._exit(EXIT_RANK_GROUP_LOST)


def add_prompt_logprobs(outcome: hp.StepOutcome, scores: PromptLogprobs) -> None:
    top_n = max((len(t) for t in scores.top), default=0)
    outcome.prompt_logprobs.add(
        seq_id=scores.seq_id,
        start=scores.start,
        logprobs=scores.logprobs,
        ranks=scores.ranks,
        top_n=top_n,
        top_ids=[t for row in scores.top for t, _ in row],
        top_logprobs=[lp for row in scores.top for _, lp in row],
    )


@dataclass
class SeqState:
    prompt: np.ndarray  # (prompt_len,) int32, copied once from a tokenizer's arena
    sampling: SamplingParams
    output_ids: list[int]  # generated before a preemption; the engine needs them for penalties
    started: bool = False
    # What this worker sampled for the sequence in its last step: the value of a PLACEHOLDER
    # decode token in the next step (the scheduler planned it before the token was known).
    last_token: int = 0


@dataclass
class InFlight:
    """A step launched (StepRunner.start) and not yet finished."""

    desc: hp.StepDescriptor
    outcome: hp.StepOutcome  # its failures so far
    start_ns: int
    started: float = field(default_factory=time.perf_counter)
    submitted: Submitted | None = None  # None: nothing went to the engine
    launch_s: float | None = None  # host seconds `start` took
    sampling: set[int] = field(default_factory=set)  # the sequences it samples

    def done(self) -> bool:
        """Its outputs are ready to collect without waiting."""
        return self.submitted is None or self.submitted.done is None or self.submitted.done.query()


class StepRunner:
    """Keeps per-sequence state (prompt source, sampling) between steps, keyed by seq id."""

    def __init__(
        self,
        engine: Engine,
        reader: Reader,
        telemetry: WorkerTelemetry | None = None,
        threads: ThreadPolicy | None = None,
    ) -> None:
        self.engine = engine
        self.reader = reader
        self.telemetry = telemetry or WorkerTelemetry()
        self.threads = threads  # None: leave torch's thread count alone (and on CUDA)
        self.seqs: dict[int, SeqState] = {}

    def reset(self) -> None:
        """A new scheduler attached: no sequence carries over."""
        self.engine.release(self.seqs)
        self.seqs.clear()
        self.telemetry.reset()

    def run(self, desc: hp.StepDescriptor) -> hp.StepOutcome:
        """One step; its telemetry waits for `telemetry.flush()` once the outcome is sent."""
        return self.finish(self.start(desc))

    def start(
        self,
        desc: hp.StepDescriptor,
        after: InFlight | None = None,
        before_launch: Callable[[], None] | None = None,
    ) -> InFlight:
        """Launch a step; `finish` waits for it. `after`: the step launched before it and not
        finished yet, whose sampled tokens fill this one's placeholders on the device.
        before_launch: Engine.submit's, called once this step's host work is done."""
        flight = InFlight(desc, hp.StepOutcome(step_id=desc.step_id), time.time_ns())
        try:
            self._start(flight, after, before_launch)
        except BaseException as err:
            self._failed(flight, err)
        flight.launch_s = time.perf_counter() - flight.started
        return flight

    def finish(self, flight: InFlight) -> hp.StepOutcome:
        outcome = flight.outcome
        try:
            outputs = [] if flight.submitted is None else self.engine.collect(flight.submitted)
        except BaseException as err:
            self._failed(flight, err)
        top_n = max((len(o.top_logprobs) for o in outputs), default=0)
        outcome.top_n = top_n
        for out in outputs:
            state = self.seqs.get(out.seq_id)  # type: ignore[call-overload]
            if state is not None:
                state.last_token = out.token_id
            outcome.seq_ids.append(out.seq_id)
            outcome.token_ids.append(out.token_id)
            outcome.logprobs.append(out.logprob)
            if top_n:
                pad = top_n - len(out.top_logprobs)
                outcome.top_ids.extend([t for t, _ in out.top_logprobs] + [-1] * pad)
                outcome.top_logprobs.extend([lp for _, lp in out.top_logprobs] + [0.0] * pad)
        if flight.submitted is not None:
            for scores in flight.submitted.prompt_scores:
                add_prompt_logprobs(outcome, scores.to_host())
        seconds = time.perf_counter() - flight.started
        self.telemetry.record(
            flight.desc, outcome, flight.start_ns, seconds, launch_s=flight.launch_s
        )
        return outcome

    def _failed(self, flight: InFlight, err: BaseException) -> NoReturn:
        if isinstance(err, RankGroupError):
            exit_group_lost(self.engine, err)
        seconds = time.perf_counter() - flight.started
        self.telemetry.record(flight.desc, None, flight.start_ns, seconds, err)
        self.telemetry.flush()
        raise err

    def _start(
        self, flight: InFlight, after: InFlight | None, before_launch: Callable[[], None] | None
    ) -> None:
        desc, outcome = flight.desc, flight.outcome
        for seq_id in desc.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        self.engine.release(desc.finished_seq_ids)
        failed: dict[int, str] = {}
        for new in desc.new_seqs:
            try:
                self.seqs[new.seq_id] = self._admit(new)
            except (ShmError, InvalidRequest) as err:
                failed[new.seq_id] = str(err)
                outcome.error = f"sequence {new.seq_id}: {err}"
        sampling = set() if after is None or after.submitted is None else after.sampling
        batch = self._batch(desc, set(failed), sampling)
        if self.threads is not None:
            wanted = self.threads.for_step(desc.num_prefill_tokens, desc.num_decode_tokens)
            if wanted != torch.get_num_threads():
                torch.set_num_threads(wanted)
        try:
            flight.submitted = self.engine.submit(batch, before_launch) if batch else None
        except InvalidRequest as err:
            # A bad sequence fails the step's sequences, never the worker.
            failed.update((int(s.seq_id), str(err)) for s in batch)  # type: ignore[call-overload]
            outcome.error = str(err)
        else:
            flight.sampling = {int(s.seq_id) for s in batch if s.sample}  # type: ignore[call-overload]
        outcome.failed_seq_ids.extend(failed)
        outcome.failed_reasons.extend(failed.values())

    def _admit(self, new: hp.NewSequence) -> SeqState:
        if new.prompt_handle:
            # A copy, checked against the region's generation after copying: the tokenizer may
            # free the prompt once the request ends, whatever step is still running.
            prompt = self.reader.copy(Handle.from_bytes(new.prompt_handle))
        else:
            prompt = np.asarray(new.prompt_ids, dtype=np.int32)
        if prompt.ndim != 1 or prompt.shape[0] != new.prompt_len:
            raise InvalidRequest(
                "prompt_len", f"prompt holds {prompt.shape} ids, not {new.prompt_len}"
            )
        # Checked here, for this sequence alone: in the step, one bad id fails every sequence.
        vocab = self.engine.config.vocab_size
        if len(prompt) and (int(prompt.min()) < 0 or int(prompt.max()) >= vocab):
            raise InvalidRequest("prompt", f"ids outside [0, {vocab}): its memory was overwritten")
        sampling = sampling_from_pb(new.sampling)
        self.engine.check_sampling(sampling)  # a grammar compiles here, failing this one alone
        return SeqState(prompt, sampling, list(new.output_ids))

    def _batch(self, desc: hp.StepDescriptor, skip: set[int], sampling: set[int]) -> list[SeqInput]:
        """sampling: sequences sampled by a step still running, whose placeholders the engine
        fills on the device (FROM_LAST_STEP); the others' from what this worker has seen."""
        batch = []
        inline = desc.inline_tokens
        blocks = desc.blocks
        i_tok = i_blk = 0
        for i, seq_id in enumerate(desc.seq_ids):
            n, from_prompt, n_blocks = desc.num_tokens[i], desc.from_prompt[i], desc.block_counts[i]
            start = desc.start_pos[i]
            n_inline = n - from_prompt
            token_slice = inline[i_tok : i_tok + n_inline]
            table = blocks[i_blk : i_blk + n_blocks]
            i_tok += n_inline
            i_blk += n_blocks
            state = self.seqs.get(seq_id)
            if state is None or seq_id in skip:
                continue
            last = FROM_LAST_STEP if seq_id in sampling else state.last_token
            tokens = state.prompt[start : start + from_prompt].tolist() + [
                last if t == PLACEHOLDER else t for t in token_slice
            ]
            prefix = None
            if not state.started and start and state.sampling.needs_history:
                # The engine tracks the history from here on; it needs what came before once.
                prefix = (state.prompt.tolist() + state.output_ids)[:start]
            state.started = True
            batch.append(
                SeqInput(
                    seq_id=seq_id,
                    token_ids=tokens,
                    start_pos=start,
                    block_table=table,
                    sampling=state.sampling,
                    sample=desc.sample[i],
                    prompt_len=len(state.prompt),
                    prefix_ids=prefix,
                )
            )
        return batch
