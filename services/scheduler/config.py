"""The scheduler's settings: its policy (flags of `tandem serve` and the scheduler process), and
the policy joined with the KV pool the worker reports, which the core is built from."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from services.address import join_address
from services.settings import flag
from services.telemetry.config import TelemetryConfig
from services.tls import TlsSettings

# The backlog budget where none is given: on a GPU the larger steps end bursts sooner without
# the steady loss of goodput a larger fixed budget has; on a CPU they cost throughput
# (bench/RESULTS-gpu.md, session 49; bench/RESULTS-cpu.md).
BACKLOG_ON_CUDA = 8192


@dataclass(frozen=True)
class SchedulingPolicy:
    # Continuous batching: per step, at most this many sequences and this many new tokens.
    max_num_seqs: int = flag(256, "sequences per step")
    max_num_batched_tokens: int = flag(2048, "new tokens per step")
    # A backlog (a burst, an overload) is worked off in larger steps: while at least
    # `backlog_batched_tokens` prompt tokens wait, a step may take that many new tokens. Those
    # steps are longer, but the queue's prompts would wait longer still behind small ones, and
    # fewer steps with the whole batch decoding end a burst sooner. Below a backlog, steps stay
    # at `max_num_batched_tokens`, which keeps the time between tokens short. 0 turns this off
    # (as does a value below max_num_batched_tokens); None: by the worker's device (`on_device`).
    backlog_batched_tokens: int | None = flag(
        None,
        "a step's new tokens while at least as many prompt tokens wait "
        f"(0: off; default {BACKLOG_ON_CUDA} on CUDA, off on CPUs)",
        env="TANDEM_BACKLOG_BATCHED_TOKENS",
    )

    # Chunked prefill. A prefill with more tokens left than the threshold is "long": it gets at
    # most `long_prefill_token_threshold` tokens per step, and at most `max_long_prefills` long
    # prefills run at once, so one huge prompt cannot hold the whole batch.
    enable_chunked_prefill: bool = flag(True, "split long prompts over steps")
    long_prefill_token_threshold: int = flag(512, "a prompt past this is long")
    max_long_prefills: int = flag(1, "long prompts prefilled at once")

    # A step that prefills a request of priority P adds no prefill tokens of lower priority, and
    # that prefill is not charged for the lower-priority decodes in the step: the high-priority
    # prompt's step is about as long as on an idle system (decodes still run every step).
    isolate_priority_prefill: bool = flag(True, "a prefill's step takes no lower-priority prefill")

    # While requests of some priority P keep arriving (one in the last `priority_horizon_s`),
    # prefill chunks of lower priorities get at most `lower_priority_prefill_tokens` per step in
    # all: steps carrying only lower-priority work stay short, so a P request arriving waits
    # little for the step already running (a step cannot be taken back once sent), while its
    # own prefill keeps the whole budget. 0 turns this off.
    lower_priority_prefill_tokens: int = flag(192, "lower-priority prefill tokens a step (0: off)")
    priority_horizon_s: float = flag(10.0, "how long a priority counts as arriving")

    enable_prefix_caching: bool = flag(True, "reuse the KV of shared prompt prefixes")
    # Finished turns of a conversation (`session_id`) keep their blocks pinned for the next turn,
    # up to this share of the pool; pins are released least-recently-used under memory pressure.
    session_kv_fraction: float = flag(0.25, "share of the KV pool sessions may pin")

    # Backpressure: a submission beyond either bound is refused at once.
    max_queued_requests: int = flag(
        1024, "waiting requests beyond which new ones get RESOURCE_EXHAUSTED"
    )
    max_queued_tokens: int = flag(
        1 << 22, "waiting prompt tokens beyond which new ones are refused"
    )

    # Aging: a waiting request gains this many priority levels per second of waiting, so the
    # worst-case wait of low priority under sustained high-priority load is bounded (by about
    # one level per 20 s by default). Keep 1 / aging_per_s above the queue wait that overload
    # causes (max_queued_requests / throughput), or aged requests outrank every newcomer.
    aging_per_s: float = flag(0.05, "priority levels a waiting request gains per second")

    # Micro-batch window (Triton's max_queue_delay): with the worker idle and fewer than
    # `window_max_seqs` requests waiting, admission may wait up to `max_wait_us` for more.
    max_wait_us: float = flag(0.0, "micro-batch window while the worker is idle (0: off)")
    window_max_seqs: int = flag(4, "the window closes once this many wait")

    # Async scheduling (overlap): `schedule()` may build step N+1 while step N runs, so the hop
    # and the scheduler's own time hide behind the worker's compute. The worker must then
    # fill each PLACEHOLDER token with its own last sample (see services/protocol.py).
    async_scheduling: bool = flag(True, "plan the next step while the worker runs this one")

    def __post_init__(self) -> None:
        positive = {
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "long_prefill_token_threshold": self.long_prefill_token_threshold,
            "max_long_prefills": self.max_long_prefills,
            "max_queued_requests": self.max_queued_requests,
            "max_queued_tokens": self.max_queued_tokens,
            "window_max_seqs": self.window_max_seqs,
        }
        for name, value in positive.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.backlog_batched_tokens is not None and self.backlog_batched_tokens < 0:
            raise ValueError(
                f"backlog_batched_tokens must be >= 0, got {self.backlog_batched_tokens}"
            )
        for name in (
            "lower_priority_prefill_tokens",
            "priority_horizon_s",
            "aging_per_s",
            "max_wait_us",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.session_kv_fraction <= 1.0:
            raise ValueError(
                f"session_kv_fraction must be in [0, 1], got {self.session_kv_fraction}"
            )

    @property
    def max_wait_s(self) -> float:
        return self.max_wait_us * 1e-6

    def on_device(self, device: str) -> SchedulingPolicy:
        """This policy with the backlog budget settled for a worker on `device` ("cuda:0")."""
        if self.backlog_batched_tokens is not None:
            return self
        backlog = BACKLOG_ON_CUDA if device.startswith("cuda") else 0
        return replace(self, backlog_batched_tokens=backlog)

    @property
    def largest_step_tokens(self) -> int:
        """The most new tokens a step may carry: what a worker must be warmed up for."""
        return max(self.max_num_batched_tokens, self.backlog_batched_tokens or 0)

    def step_tokens(self, waiting_tokens: int) -> int:
        """The new-token budget of a step built while `waiting_tokens` prompt tokens wait."""
        backlog = self.backlog_batched_tokens or 0
        if backlog and waiting_tokens >= backlog:
            return max(backlog, self.max_num_batched_tokens)
        return self.max_num_batched_tokens


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig(SchedulingPolicy):
    """The policy and the KV pool as the worker reports it at start (the scheduler keeps the
    accounts only)."""

    num_kv_blocks: int
    block_size: int
    max_model_len: int

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_kv_blocks", "block_size", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # Without chunking a prompt must go in one step, so the budget must hold the longest.
            raise ValueError(
                "max_num_batched_tokens must be >= max_model_len when chunked prefill is off "
                f"({self.max_num_batched_tokens} < {self.max_model_len})"
            )

    @classmethod
    def for_worker(cls, policy: SchedulingPolicy, model: Any) -> SchedulerConfig:
        """The policy joined with what a worker reports (a ModelDescription): its KV pool,
        context and device."""
        return cls(
            **vars(policy.on_device(model.device)),
            num_kv_blocks=model.num_kv_blocks,
            block_size=model.block_size,
            max_model_len=model.max_seq_len,
        )

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size


@dataclass(frozen=True)
class SchedulerProcessConfig:
    host: str = flag("127.0.0.1", "address to bind")
    port: int = flag(50052, "gRPC port")
    worker: str = flag("127.0.0.1:50053", "the worker's address")
    transport: str = flag(
        "shm",
        "hot path through shared memory (same host) or gRPC (across hosts)",
        choices=("shm", "grpc"),
    )
    policy: SchedulingPolicy = field(default_factory=SchedulingPolicy)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    # Across hosts: TLS on this port, and on the channel to a worker on another host.
    tls: TlsSettings = field(default_factory=TlsSettings)

    @property
    def address(self) -> str:
        return join_address(self.host, self.port)
