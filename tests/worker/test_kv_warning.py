"""A worker whose KV cache is smaller than one full context says so as it starts: such a server
refuses every request longer than its cache, each with a message, and the log says why."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest


def _start_log(kv_cache_mb: int) -> str:
    """The worker's log up to the line saying it serves, then it is stopped."""
    argv = [sys.executable, "-m", "services.worker", "--model", "llama3-tiny-random"]
    argv += ["--kv-cache-mb", str(kv_cache_mb), "--port", "0"]
    worker = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    assert worker.stderr is not None
    lines = []
    try:
        for line in worker.stderr:
            lines.append(line)
            if "worker on port" in line:
                break
    finally:
        worker.send_signal(signal.SIGINT)
        worker.communicate(timeout=60)
    log = "".join(lines)
    assert "worker on port" in log, log
    return log


@pytest.mark.slow
def test_a_kv_cache_below_one_context_is_named_at_start() -> None:
    # The tiny model's context is 2,048 tokens; 1 MiB holds 512 of them.
    log = _start_log(1)
    assert "the KV cache holds 512 tokens, less than one full context of 2048" in log
    assert "--kv-cache-mb sets its size" in log
    assert "KV cache holds" not in _start_log(64)


@pytest.mark.slow
def test_the_vocabulary_for_output_formats_is_read_before_serving() -> None:
    log = _start_log(64)
    assert log.index("vocabulary for output formats read in") < log.index("worker on port")
