"""The one error the shared-memory layer raises: it names what was wrong with a segment or handle."""


class ShmError(Exception):
    """A segment or handle that cannot be used safely (unknown, stale, out of bounds, corrupt)."""
