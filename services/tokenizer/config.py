"""The tokenizer process's settings: the public door, and the scheduler it submits to."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.address import join_address
from services.settings import flag
from services.telemetry.config import TelemetryConfig
from services.tls import TlsSettings
from services.worker.config import ModelSettings


@dataclass(frozen=True)
class EdgeSettings:
    """The door's settings, declared once: `tandem serve`'s extend them and reach each of its
    tokenizers as they are."""

    model: ModelSettings = field(default_factory=ModelSettings)
    tokenizer: str = flag("", "a tokenizer name or path instead of the model's")
    served_model_name: str = flag(
        "",
        "the model's name to clients: what requests give as `model`, and responses and "
        "/v1/models say (default: --model as given)",
    )
    chat_template: str = flag(
        "",
        "a Jinja chat template, as a file's path or the text itself, instead of the model's "
        "(for a model that has none, or to change it)",
    )
    tool_call_format: str = flag(
        "auto",
        "how the model writes tool calls, which the HTTP API holds its replies to and reads: "
        'json ({"name", "parameters"}, LLaMA-3.x), hermes (<tool_call>...</tool_call>), '
        "mistral ([TOOL_CALLS] [...]), mistral-args ([TOOL_CALLS]name[ARGS]{...}); auto: from "
        "the chat template's text",
        choices=("auto", "json", "hermes", "mistral", "mistral-args"),
    )
    reasoning_format: str = flag(
        "auto",
        "deepseek: a chat reply's <think>...</think> part (DeepSeek-R1's reasoning) is answered "
        "as reasoning_content, apart from its content; none: all of it is content; auto: "
        "deepseek where the chat template writes <think>",
        choices=("auto", "none", "deepseek"),
    )
    host: str = flag("127.0.0.1", "public address to bind")
    port: int = flag(50051, "public gRPC port (0: a free one)")
    http_port: int = flag(8000, "public OpenAI-compatible HTTP port, on --host (0: off)")
    http_body_timeout_s: float = flag(
        60.0,
        "seconds an HTTP request's body may take to arrive, from its headers; a slower one gets "
        "408 and its connection is closed (0: no limit)",
    )
    api_key: tuple[str, ...] = flag(
        (),
        "clients must send `Authorization: Bearer KEY` (HTTP) or the metadata `authorization: "
        "Bearer KEY` (gRPC); health checks stay open (none: the API is open)",
        env="TANDEM_API_KEY",
    )
    tls: TlsSettings = field(default_factory=TlsSettings)
    transport: str = flag(
        "shm", "prompts and events through shared memory, or all over gRPC", choices=("shm", "grpc")
    )
    arena_mb: int = flag(64, "each tokenizer's shared memory for prompts, in MiB")

    def __post_init__(self) -> None:
        for name in ("port", "http_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} must be in [0, 65536), got {getattr(self, name)}")
        if self.port and self.port == self.http_port:
            raise ValueError(
                f"port and http_port are both {self.port}: gRPC and HTTP need a port each"
            )
        if any(not key for key in self.api_key):
            raise ValueError("an API key must not be empty")
        if not self.http_body_timeout_s >= 0:
            raise ValueError(f"http_body_timeout_s must be >= 0, got {self.http_body_timeout_s}")
        if self.arena_mb < 1:
            raise ValueError("the prompt arena needs at least 1 MiB")

    @property
    def address(self) -> str:
        return join_address(self.host, self.port)


@dataclass(frozen=True)
class TokenizerConfig(EdgeSettings):
    admin_port: int = flag(
        0, "a port of this process alone (health, metrics) when several share --port"
    )
    scheduler: str = flag("127.0.0.1:50052", "the scheduler's address")
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
