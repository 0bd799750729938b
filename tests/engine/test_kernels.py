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
    assert done.stdout.count("max error") == 41 and done.stdout.count("relative error") == 86


def test_prefill_attention_takes_four_heads_a_program_where_they_fill_the_gpu() -> None:
    from engine.kernels.prefill_attention import LONG_TILES, TILES, measured_tiles

    assert measured_tiles(2048, 32, 8, 128) == LONG_TILES  # LLaMA-3-8B: 8 × 32 programs
    assert measured_tiles(1985, 32, 8, 128) == LONG_TILES
    assert measured_tiles(1984, 32, 8, 128) == TILES  # 8 × 31
    assert measured_tiles(512, 64, 8, 128) == TILES  # 70B's groups of 8: 16 × 8
    assert measured_tiles(1024, 64, 8, 128) == LONG_TILES
    assert measured_tiles(2048, 16, 4, 128) == TILES  # an 8B tensor-parallel shard: 4 × 32
    assert measured_tiles(4096, 16, 4, 128) == LONG_TILES
    assert measured_tiles(8192, 9, 3, 64) == TILES  # SmolLM2: groups of 3, heads of 64
    assert measured_tiles(8192, 32, 32, 128) == TILES  # no GQA
