"""The engine's errors: each names what the user got wrong, so callers can show it as is."""


class EngineError(Exception):
    """Base class for errors a user can act on."""


class ModelNotFound(EngineError):
    """An unknown model name, or a path that does not exist."""


class ModelFormatError(EngineError):
    """A model file that cannot be read: corrupt, truncated, or of an unsupported kind."""


class FetchError(EngineError):
    """A model file could not be downloaded or failed its checksum."""


class InvalidRequest(EngineError, ValueError):
    """A generation request with a bad field; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ContextLengthExceeded(InvalidRequest):
    """A prompt, or a prompt and the tokens asked for, longer than the context served. OpenAI's
    API gives it its own code, which clients read to shorten a conversation and try again."""

    code = "context_length_exceeded"


class RankGroupError(EngineError):
    """A rank of a tensor-parallel group died or could not start: the group cannot step again
    and must be started afresh (engine/rank_group.py)."""
