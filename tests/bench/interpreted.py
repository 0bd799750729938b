"""Bench kernels' checks, run on the CPU in Triton's interpreter (CI has no GPU)."""

from __future__ import annotations

import os
import subprocess
import sys


def run_interpreted(code: str) -> str:
    """`code` run by a fresh Python with TRITON_INTERPRET=1 (it must be set before Triton is
    imported); its standard output, once it has exited 0."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout
