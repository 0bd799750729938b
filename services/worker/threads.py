"""How many CPU threads each step's model work gets.

Between the tiny ops of a one-row decode step a second OpenMP thread either sleeps and must be
woken, or spins on the core the tokenizer, scheduler and client need (nice 19 or SCHED_IDLE for
them does not help). So small decode steps leave a core to the other processes; batched steps
and prefills take them all. Measured in bench/RESULTS-cpu.md ("Threads per step").
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
