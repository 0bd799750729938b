"""Structured outputs under load: the same chat workload free and held to a JSON Schema, through
tandem's OpenAI-compatible API and through llama.cpp's server (which holds output to a schema
with its own grammar engine), on the same GGUF: the tables of bench/RESULTS-structured.md.

    python -m bench.structured --llama-server /work/peers/bin/llama-server-build/bin/llama-server

Each server serves alone (a shared 2-core machine would slow two at once). Against each, the
free and the held workloads alternate for `--rounds` rounds: `--num-requests` chat requests, at
most `--concurrency` at once, each asking to describe a different person, streamed with the
`openai` SDK. An output is valid when it parses as JSON and jsonschema (not the engine that
held it) accepts it. Time per output token is each request's time from its first to its last
token over the tokens between; tok/s is all output tokens over the run's wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jsonschema
import openai

from bench.cli import tandem_home
from bench.guided_steps import engine_steps
from bench.guided_steps import table as steps_table
from bench.openai_compare import wait_healthy
from engine import registry
from harness.pipeline import pipeline
from services.launcher import free_port

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 32},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
NAMES = ["Ann", "Bo", "Chen", "Dara", "Emeka", "Fatima", "Gus", "Hana", "Ivan", "Jo", "Kofi", "Lea"]
JOBS = ["baker", "pilot", "nurse", "farmer"]
MODES = ("free", "json_schema")


def prompts(n: int, run: int) -> list[str]:
    """Prompts no earlier run sent: a server finds none whole in its prefix cache."""
    return [
        f"Describe {NAMES[i % len(NAMES)]}, a {JOBS[i // len(NAMES) % len(JOBS)]}, with their "
        f"name, age, city and hobbies. (Request {run}.{i}.)"
        for i in range(n)
    ]


async def one(
    client: openai.AsyncOpenAI, model: str, prompt: str, mode: str, args: argparse.Namespace
) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if mode == "json_schema":
        extra["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        }
    started = time.perf_counter()
    stamps: list[float] = []
    text = ""
    tokens = 0
    finish = None
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=args.max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        **extra,
    )
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            if choice.delta.content:
                stamps.append(time.perf_counter())
                text += choice.delta.content
            finish = choice.finish_reason or finish
    try:
        jsonschema.validate(json.loads(text), PERSON)
        valid = True
    except (ValueError, jsonschema.ValidationError):
        valid = False
    per_token = (stamps[-1] - stamps[0]) / (tokens - 1) if tokens > 1 and stamps else None
    return {
        "tokens": tokens,
        "valid": valid,
        "finish": finish,
        "ttft_s": stamps[0] - started if stamps else None,
        "tpot_s": per_token,
        "text": text,
    }


async def workload(
    url: str, model: str, mode: str, run: int, args: argparse.Namespace
) -> dict[str, Any]:
    gate = asyncio.Semaphore(args.concurrency)
    # A connection per request: llama.cpp's server closes a kept-alive connection after a few
    # requests, and a request sent on it as it closes fails ("Server disconnected").
    async with openai.AsyncOpenAI(
        base_url=url,
        api_key="-",
        max_retries=0,
        timeout=600,
        default_headers={"Connection": "close"},
    ) as client:

        async def gated(prompt: str) -> dict[str, Any]:
            async with gate:
                return await one(client, model, prompt, mode, args)

        started = time.perf_counter()
        results = await asyncio.gather(*(gated(p) for p in prompts(args.num_requests, run)))
        wall = time.perf_counter() - started
    tpots = sorted(r["tpot_s"] for r in results if r["tpot_s"] is not None)
    tokens = sum(r["tokens"] for r in results)
    return {
        "requests": len(results),
        "valid": sum(r["valid"] for r in results),
        "stopped": sum(r["finish"] == "stop" for r in results),
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tok_s": tokens / wall,
        "tpot_p50_ms": 1000 * statistics.median(tpots) if tpots else None,
        "ttft_p50_ms": 1000 * statistics.median(r["ttft_s"] for r in results if r["ttft_s"]),
        "sample": results[0]["text"],
    }


class LlamaServer:
    """llama.cpp's server on the same GGUF, as bench/RESULTS-cpu.md runs it."""

    def __init__(self, binary: str, gguf: Path, concurrency: int, log: Path) -> None:
        self.port = free_port()
        self.cmd = [
            binary, "-m", str(gguf), "-t", "2", "-np", str(concurrency), "-cb", "-c", "8192",
            "--host", "127.0.0.1", "--port", str(self.port),
        ]  # fmt: skip
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        with self.log.open("a") as log:
            self.process = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=log)
        wait_healthy(f"http://127.0.0.1:{self.port}/health")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=60)


def rounds(url: str, model: str, server: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    warm = argparse.Namespace(**{**vars(args), "num_requests": 4})
    asyncio.run(workload(url, model, "json_schema", -1, warm))  # first compiles and requests
    out = []
    for r in range(args.rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            run = asyncio.run(workload(url, model, mode, 2 * r + MODES.index(mode), args))
            run.update(server=server, mode=mode, round=r)
            print(
                f"{server:9s} {mode:11s} round {r}: {run['output_tok_s']:6.1f} tok/s, "
                f"{run['valid']}/{run['requests']} valid, TPOT p50 {run['tpot_p50_ms']:.1f} ms",
                flush=True,
            )
            out.append(run)
    return out


def table(runs: list[dict[str, Any]]) -> str:
    lines = [
        "| server | output | valid JSON (schema) | ended by itself | output tok/s | TPOT p50 (ms) "
        "| TTFT p50 (ms) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for server in ("tandem", "llama.cpp"):
        for mode in MODES:
            rs = [r for r in runs if r["server"] == server and r["mode"] == mode]
            if not rs:
                continue
            n = sum(r["requests"] for r in rs)
            valid = sum(r["valid"] for r in rs)
            stopped = sum(r["stopped"] for r in rs)
            tok_s = sum(r["output_tokens"] for r in rs) / sum(r["wall_s"] for r in rs)
            tpot = statistics.median(r["tpot_p50_ms"] for r in rs)
            ttft = statistics.median(r["ttft_p50_ms"] for r in rs)
            cells = [server, mode, f"{valid}/{n}", f"{stopped}/{n}", f"{tok_s:.1f}", f"{tpot:.1f}"]
            lines.append("| " + " | ".join([*cells, f"{ttft:.0f}"]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--llama-server", help="llama.cpp's server binary; left out: tandem only")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--engine-rows", type=int, default=16, help="sequences of a decode step")
    parser.add_argument("--json", type=Path, default=Path("bench/RESULTS-structured.json"))
    args = parser.parse_args(argv)
    gguf = registry.fetch_any(registry.lookup(registry.DEFAULT_MODEL), tandem_home(), quiet=True)
    results: dict[str, Any] = {"config": {k: str(v) for k, v in vars(args).items()}, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with pipeline(work) as served:
            results["runs"] += rounds(served.http_url, "", "tandem", args)
        if args.llama_server:
            llama = LlamaServer(args.llama_server, gguf, args.concurrency, work / "llama.log")
            llama.start()
            try:
                results["runs"] += rounds(llama.url, gguf.name, "llama.cpp", args)
            finally:
                llama.stop()
    results["engine_steps"] = engine_steps(gguf, [args.engine_rows], 48, 2 * args.rounds)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results["runs"]))
    print(f"\nengine alone, a decode step:\n{steps_table(results['engine_steps'])}")
    print(f"results: {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
