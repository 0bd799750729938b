"""How one request ended, judged by the campaign's definitions, and the tally of a campaign.

ok            the call ended as asked: a stream with finish_reason stop or length, a unary call
              with a response, or a cancellation the client made itself.
clear_error   a failed call that ended with a gRPC status whose details name the problem:
              not UNKNOWN, not INTERNAL's generic "internal error in ...; see server log", not
              empty, and not a timeout of the client's own.
unclear_error a failed call that ended any other way (the three exclusions above).
hung          no end, and no message either, within the campaign's bounded wait (HANG_S).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import grpc
from grpc import aio

# A request with neither a message nor its end for this long is hung (the wait is bounded).
HANG_S = 120.0
_GENERIC = re.compile(r"internal error in \S+; see server log")
KINDS = ("ok", "clear_error", "unclear_error", "hung")


@dataclass
class Outcome:
    kind: str  # one of KINDS
    code: str  # OK, CANCELLED (by the client), a finish reason, or the status code's name
    details: str = ""
    ttft_s: float | None = None  # call start to the first message with a token
    tokens: int = 0
    cancelled_at: str = ""  # where the client cancelled: "", "submit", "prefill", "decode"


def ok(code: str = "OK", **kw: object) -> Outcome:
    return Outcome("ok", code, **kw)  # type: ignore[arg-type]


def hung(bound_s: float = HANG_S, **kw: object) -> Outcome:
    return Outcome("hung", "HUNG", f"no message and no end for {bound_s:.0f} s", **kw)  # type: ignore[arg-type]


def of_error(err: aio.AioRpcError, **kw: object) -> Outcome:
    code, details = err.code(), err.details() or ""
    clear = (
        code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.OK)
        and bool(details.strip())
        and not _GENERIC.search(details)
    )
    return Outcome("clear_error" if clear else "unclear_error", code.name, details, **kw)  # type: ignore[arg-type]


@dataclass
class Tally:
    """Every request of a campaign (or of one part of it), by kind and by status."""

    kinds: Counter[str] = field(default_factory=Counter)
    codes: Counter[str] = field(default_factory=Counter)
    # A few details of each status that was not OK, to quote in the results.
    examples: dict[str, str] = field(default_factory=dict)
    unclear: list[str] = field(default_factory=list)

    def add(self, outcome: Outcome) -> Outcome:
        self.kinds[outcome.kind] += 1
        self.codes[outcome.code] += 1
        if outcome.kind != "ok":
            self.examples.setdefault(outcome.code, outcome.details[:200])
        if outcome.kind in ("unclear_error", "hung") and len(self.unclear) < 20:
            self.unclear.append(f"{outcome.code}: {outcome.details[:300]}")
        return outcome

    def merge(self, other: Tally) -> None:
        self.kinds.update(other.kinds)
        self.codes.update(other.codes)
        for code, details in other.examples.items():
            self.examples.setdefault(code, details)
        self.unclear.extend(other.unclear[: max(0, 20 - len(self.unclear))])

    @property
    def requests(self) -> int:
        return sum(self.kinds.values())
