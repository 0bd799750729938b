"""`tandem bench` from the command line: one table for two servers, the JSON file, the plot."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import StartTandem
from fake_openai import Reply, serve
from fake_tandem import Plan

from services import cli_bench

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


async def tandem(*argv: str) -> int:
    # The lead registers the module in services.cli; until then, a parser of our own.
    parser = argparse.ArgumentParser(prog="tandem")
    cli_bench.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    # In a thread: the command runs its own event loop, the fake servers run in this one.
    return int(await asyncio.to_thread(args.func, args))


async def test_side_by_side_table_json_and_plot(
    tandem_server: StartTandem, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    address, _ = await tandem_server(lambda _: Plan(steps=((0.05, 1), (0.05, 2))))
    out_json, out_png = tmp_path / "run.json", tmp_path / "run.png"
    with serve(lambda _: Reply(steps=((0.05, "a"), (0.05, "b")), usage_tokens=2)) as fake:
        code = await tandem(
            "bench",
            "--backend", "tandem", "--url", address,
            "--backend", "openai", "--url", fake.url,
            "--prompt-len", "16", "--output-len", "3", "--ignore-eos",
            "--concurrency", "2", "--num-requests", "6", "--warmup", "2",
            "--json", str(out_json), "--plot", str(out_png), "--no-progress",
        )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0]
    assert f"tandem {address}" in header and f"openai {fake.url}" in header
    [counts] = [line for line in out.splitlines() if line.startswith("requests ok / failed")]
    assert counts.split()[-6:] == ["6", "/", "0", "6", "/", "0"]

    data = json.loads(out_json.read_text())
    assert data["config"]["prompt_len"] == 16
    tandem_run, openai_run = data["runs"]
    assert tandem_run["target"] == {"backend": "tandem", "url": address}
    assert [r["warmup"] for r in tandem_run["records"]] == [True] * 2 + [False] * 6
    assert {r["output_tokens"] for r in tandem_run["records"]} == {3}
    assert {r["output_tokens"] for r in openai_run["records"]} == {2}
    assert all(len(r["chunks"]) == 2 and r["ttft_s"] > 0 for r in openai_run["records"])
    [summary] = tandem_run["summary"]
    assert summary["group"] == "all" and summary["ok"] == 6
    assert summary["ttft_s"]["p50"] > 0.03
    assert summary["cached_prompt_tokens_mean"] == 2
    assert "of them cached" in out
    assert out_png.read_bytes().startswith(PNG_MAGIC)


async def test_priority_mix_columns_and_failures(
    tandem_server: StartTandem, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    address, _ = await tandem_server(lambda _: Plan(steps=((0.01, 1),)))
    out_json = tmp_path / "mix.json"
    code = await tandem(
        "bench", "--url", address, "--priority-mix", "0:1,10:1", "--num-requests", "30",
        "--concurrency", "4", "--json", str(out_json), "--plot", str(tmp_path / "mix.png"),
        "--no-progress",
    )  # fmt: skip
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["all", "priority", "0", "priority", "10"]
    assert len(lines[2]) == len(lines[1]) and set(lines[2]) == {"-"}
    groups = [s["group"] for s in json.loads(out_json.read_text())["runs"][0]["summary"]]
    assert groups == ["all", "priority 0", "priority 10"]


async def test_a_server_that_answers_nothing_exits_1_and_says_why(
    closed_address: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = await tandem("bench", "--url", closed_address, "--num-requests", "2", "--no-progress")
    assert code == 1
    out = capsys.readouterr().out
    assert "0 / 2" in out and "2 × UNAVAILABLE" in out


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        (["--backend", "openai", "--priority-mix", "0:1,5:1"], "tandem targets only"),
        (["--backend", "tandem", "--backend", "openai", "--url", "h:1"], "one --url per"),
        (["--backend", "openai", "--url", "127.0.0.1:8080"], "http://HOST:PORT"),
    ],
)
async def test_bad_flags_exit_2(
    argv: list[str], complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert await tandem("bench", *argv) == 2
    assert complaint in capsys.readouterr().err


def test_a_benchmarks_help_says_its_whole_first_paragraph() -> None:
    """`--help` of a benchmark states what it measures: the docstring's first paragraph, where its
    first line alone stopped mid-sentence ("… arrival rate (`tandem bench --rate`) that")."""
    run = subprocess.run(
        [sys.executable, "-m", "bench.goodput", "--help"], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    help_text = " ".join(run.stdout.split())
    assert "that holds TTFT p99 ≤ 500 ms and ITL p99 ≤ 50 ms, as vLLM and SGLang publish it." in (
        help_text
    )
    assert "python -m bench.goodput" not in help_text  # the usage example stays in the docstring
