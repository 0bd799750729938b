"""How many CPU threads each step's model work gets.

The worker shares the machine's cores with the tokenizer, the scheduler and often the client. A
model thread that loses its core to them stalls every parallel op until it is scheduled again,
so when the model holds every core, each token's work elsewhere costs a stall. Small decode
steps gain little from a second thread (on 2 cores, one SmolLM2 token: 14 ms on two, 19 ms on
one) and lose the most to stalls, so they leave a core free; batched steps and prefills, which
the extra threads speed up nearly linearly, take them all. Measured through the pipeline on 2
cores (tok/s, one thread / two): 1 stream 47 / 35, 4 streams 104 / 102, 8 streams 101 / 136,
16 streams 151 / 195.
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
