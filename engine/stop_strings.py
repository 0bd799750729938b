"""Stop strings, applied where text is produced: text is held back while it may begin a stop."""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Fed text deltas, returns what is safe to show; a matched stop string itself is not shown."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, delta: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return delta
        text = self._held + delta
        hits = [(i, stop) for stop in self.stops if (i := text.find(stop)) >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])  # the first to begin
            self.stopped = True
            self._held = ""
            return text[:at]
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """At the end of generation, text held back for a stop that never completed."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
