"""The GPU kernels' arithmetic, checked on the CPU in Triton's interpreter (CI has no GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_triton_kernels_match_references_in_the_interpreter() -> None:
    script = Path(__file__).with_name("kernel_checks.py")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("max error") == 32 and done.stdout.count("relative error") == 74
