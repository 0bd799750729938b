"""The tokenizer process's settings: the public door, and the scheduler it submits to."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.settings import flag
from services.telemetry.config import TelemetryConfig
from services.worker.config import ModelSettings


@dataclass(frozen=True)
class TokenizerConfig:
    model: ModelSettings = field(default_factory=ModelSettings)
    tokenizer: str = flag("", "a tokenizer name or path instead of the model's")
    host: str = flag("127.0.0.1", "public address to bind")
    port: int = flag(50051, "public gRPC port")
    admin_port: int = flag(
        0, "a port of this process alone (health, metrics) when several share --port"
    )
    scheduler: str = flag("127.0.0.1:50052", "the scheduler's address")
    transport: str = flag(
        "shm", "prompts and events through shared memory, or all over gRPC", choices=("shm", "grpc")
    )
    arena_mb: int = flag(64, "shared memory for prompts, in MiB")
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.arena_mb < 1:
            raise ValueError("the prompt arena needs at least 1 MiB")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"
