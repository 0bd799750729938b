"""bench.cpu_kv_pages on the real default model, a short context: both pools give the same
logits for every layout, and each (layout, pool) has its row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_both_pools_answer_alike_in_both_layouts(default_gguf: Path, tmp_path: Path) -> None:
    from engine import cpu_kernels

    if not cpu_kernels.load():
        pytest.skip("the native CPU kernels do not build on this machine")
    out = tmp_path / "pages.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.cpu_kv_pages", "--context", "40", "--steps", "2",
         "--rounds", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=dict(os.environ),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {(r["layout"], r["pool"]) for r in rows} == {
        (layout, pool)
        for layout in ("scattered", "in order")
        for pool in ("huge pages", "4 KB pages")
    }
    assert all(r["same_logits"] and len(r["rounds_ms"]) == 2 for r in rows)
