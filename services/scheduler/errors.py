"""What `Scheduler.add_request` raises; each maps to one gRPC status code at the service edge."""


class SchedulerError(Exception):
    """Base class for errors the scheduler reports to a caller."""


class InvalidRequest(SchedulerError):
    """A request that can never be served as given (INVALID_ARGUMENT); `field` names the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class QueueFull(SchedulerError):
    """The bounded waiting queue is full (RESOURCE_EXHAUSTED); the client should back off."""
