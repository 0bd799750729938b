"""Errors of the shared-memory layer: each names what was wrong with a segment, handle or ring."""


class ShmError(Exception):
    """A segment or handle that cannot be used safely (unknown, stale, out of bounds, corrupt)."""


class ArenaFull(ShmError):
    """No free region is large enough; the caller may free regions and retry, or back off."""


class PeerGone(ShmError):
    """The process at the other end of a ring died; nothing more will arrive."""
