"""How many CPU threads each step's model work gets.

A one-row decode step is hundreds of tiny ops; between their parallel regions a second OpenMP
thread either sleeps and must be woken for the next (GOMP's default, slower than spinning), or
spins and takes the core that the tokenizer, scheduler and client need (`OMP_WAIT_POLICY=ACTIVE`,
far slower through the pipeline). Giving the other processes lower priority (nice 19,
SCHED_IDLE) changed nothing. So small decode steps leave a core to the other processes; batched
steps and prefills, which the extra threads speed up nearly linearly, take them all. The
measurements behind the threshold: bench/RESULTS-cpu.md ("Threads per step").
"""

from __future__ import annotations

from dataclasses import dataclass

# Decode-only steps of at most this many rows are small.
SMALL_STEP_ROWS = 4


@dataclass(frozen=True)
class ThreadPolicy:
    threads: int  # for batched steps and prefills
    cores: int  # the machine's

    def for_step(self, prefill_tokens: int, decode_tokens: int) -> int:
        if prefill_tokens == 0 and decode_tokens <= SMALL_STEP_ROWS:
            return max(1, min(self.threads, self.cores - 1))
        return self.threads
