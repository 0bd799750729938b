"""shm_probe.py, which the deploy test pipes into containers, run here the same way (`python -`).

In this PID namespace it must name what a live process of it holds, alive, and a killed owner's
segment dead and held by no one: what tells a crashed stage's segments from a live one's.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from shm.segment import Segment, SegmentKind
from tests.deploy.compose_local import ROOT

PROBE = ROOT / "tests" / "deploy" / "shm_probe.py"
OWNER = (
    "import sys, time\n"
    "from shm.segment import Segment, SegmentKind\n"
    "s = Segment.create(1 << 16, SegmentKind.ARENA)\n"
    "print(s.name, flush=True)\n"
    "time.sleep(600)\n"
)


def probe() -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-"],
        input=PROBE.read_text(),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=True,
    )
    return dict(json.loads(done.stdout))


def alive_of(seen: dict[str, Any]) -> dict[str, bool]:
    return {e["name"]: e["alive"] for e in seen["entries"]}


def test_a_live_owner_holds_its_segment_and_a_killed_ones_is_dead_and_held_by_none() -> None:
    with Segment.create(1 << 16, SegmentKind.ARENA) as mine:
        owner = subprocess.Popen(
            [sys.executable, "-c", OWNER], cwd=ROOT, stdout=subprocess.PIPE, text=True
        )
        theirs = ""
        try:
            assert owner.stdout is not None
            theirs = owner.stdout.readline().strip()
            assert theirs.startswith("/tandem-"), theirs
            seen = probe()
            assert seen["pid_ns"].startswith("pid:[")
            assert {mine.name[1:], theirs[1:]} <= set(seen["held"])
            assert alive_of(seen)[mine.name[1:]] and alive_of(seen)[theirs[1:]]

            owner.send_signal(signal.SIGKILL)
            owner.wait(timeout=30)
            seen = probe()
            assert theirs[1:] not in seen["held"] and mine.name[1:] in seen["held"]
            assert alive_of(seen)[theirs[1:]] is False
        finally:
            owner.kill()
            owner.wait(timeout=30)
            if theirs.startswith("/tandem-"):  # what the killed owner left; nothing else
                Path("/dev/shm", theirs[1:]).unlink(missing_ok=True)
    assert mine.name[1:] not in alive_of(probe())
