"""What one `tandem bench` run does: its targets and its workload, validated once."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

BackendName = Literal["tandem", "openai"]
Endpoint = Literal["completions", "chat"]
Dataset = Literal["random", "chat"]

BACKENDS: tuple[BackendName, ...] = ("tandem", "openai")
DEFAULT_URLS: dict[BackendName, str] = {
    "tandem": "127.0.0.1:50051",
    "openai": "http://127.0.0.1:8080",
}
DEFAULT_NUM_REQUESTS = 100


class BenchConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Target:
    backend: BackendName
    url: str  # HOST:PORT for tandem, http://HOST:PORT for openai

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise BenchConfigError(f"--backend must be one of {', '.join(BACKENDS)}")
        if self.backend == "openai" and not self.url.startswith(("http://", "https://")):
            raise BenchConfigError(f"an openai --url is http://HOST:PORT, got {self.url!r}")
        if self.backend == "tandem" and "://" in self.url:
            raise BenchConfigError(f"a tandem --url is HOST:PORT, got {self.url!r}")

    @property
    def label(self) -> str:
        return f"{self.backend} {self.url}"


@dataclass(frozen=True)
class BenchConfig:
    targets: tuple[Target, ...]
    endpoint: Endpoint = "completions"  # openai targets only
    model: str | None = None  # sent to openai targets; None: the first of GET /v1/models
    api_key: str | None = None  # a Bearer token for every target
    dataset: Dataset = "random"
    prompt_len: int = 256  # words of the token-stable text: one token each
    output_len: int = 128
    # Lengths are drawn uniformly from [n·(1−r), n·(1+r)], as vLLM's --random-range-ratio.
    random_range: float = 0.0
    concurrency: int | None = None  # without --rate: requests in flight (default 1); with: a cap
    rate: float | None = None  # Poisson arrivals, requests per second
    priority_mix: tuple[tuple[int, float], ...] = ((0, 1.0),)  # (priority, weight)
    ignore_eos: bool = False
    temperature: float = 0.0
    seed: int = 0
    duration: float | None = None  # seconds of sending; the requests in flight then finish
    num_requests: int | None = None  # None with no duration: DEFAULT_NUM_REQUESTS
    warmup: int = 0
    timeout: float | None = 600.0  # per request, seconds
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.targets:
            raise BenchConfigError("give at least one --backend/--url target")
        if self.endpoint not in ("completions", "chat"):
            raise BenchConfigError("--endpoint must be completions or chat")
        if self.dataset not in ("random", "chat"):
            raise BenchConfigError("--dataset must be random or chat")
        has_openai = any(t.backend == "openai" for t in self.targets)
        if has_openai and self.dataset == "chat" and self.endpoint == "completions":
            # A chat prompt needs the server's chat template; /v1/completions would skip it.
            raise BenchConfigError("--dataset chat with an openai target needs --endpoint chat")
        if has_openai and len(self.priority_mix) > 1:
            raise BenchConfigError("--priority-mix is for tandem targets only")
        _positive("--prompt-len", self.prompt_len)
        _positive("--output-len", self.output_len)
        if not 0.0 <= self.random_range < 1.0:
            raise BenchConfigError("--random-range must be in [0, 1)")
        _positive("--concurrency", self.concurrency)
        if self.rate is not None and not (self.rate > 0 and math.isfinite(self.rate)):
            raise BenchConfigError("--rate must be a positive number of requests per second")
        if self.duration is not None and self.num_requests is not None:
            raise BenchConfigError("give --duration or --num-requests, not both")
        if self.duration is not None and not self.duration > 0:
            raise BenchConfigError("--duration must be positive")
        _positive("--num-requests", self.num_requests)
        if self.warmup < 0:
            raise BenchConfigError("--warmup must be >= 0")
        if self.timeout is not None and not self.timeout > 0:
            raise BenchConfigError("--timeout must be positive")
        if self.temperature < 0:
            raise BenchConfigError("--temperature must be >= 0")

    @property
    def chat_prompts(self) -> bool:
        """Every backend applies the chat template: to compare, all servers must do the same."""
        return self.dataset == "chat" or self.endpoint == "chat"

    @property
    def in_flight_cap(self) -> int | None:
        if self.rate is None:
            return self.concurrency or 1
        return self.concurrency

    @property
    def measured_requests(self) -> int | None:
        """How many requests are measured; None when --duration decides."""
        if self.duration is not None:
            return None
        return self.num_requests or DEFAULT_NUM_REQUESTS


def backend_named(name: str) -> BackendName:
    for backend in BACKENDS:
        if backend == name:
            return backend
    raise BenchConfigError(f"--backend must be one of {', '.join(BACKENDS)}, got {name!r}")


def _positive(flag: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise BenchConfigError(f"{flag} must be >= 1")


def parse_priority_mix(text: str) -> tuple[tuple[int, float], ...]:
    """`"0:0.9,10:0.1"` → ((0, 0.9), (10, 0.1)); weights need not sum to one."""
    mix: dict[int, float] = {}
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        priority, sep, weight = part.partition(":")
        try:
            p, w = int(priority), float(weight) if sep else float("nan")
        except ValueError:
            raise BenchConfigError(
                f"--priority-mix: expected PRIORITY:WEIGHT, got {part!r}"
            ) from None
        if not (w > 0 and math.isfinite(w)):
            raise BenchConfigError(f"--priority-mix: weight of {p} must be positive, got {part!r}")
        if p in mix:
            raise BenchConfigError(f"--priority-mix: priority {p} given twice")
        mix[p] = w
    if not mix:
        raise BenchConfigError("--priority-mix is empty")
    return tuple(mix.items())
