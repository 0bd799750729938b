"""`tandem bench`: load one or more servers with the same requests and compare them.

    tandem bench --backend tandem --url 127.0.0.1:50051 \\
                 --backend openai --url http://127.0.0.1:8080 \\
                 --prompt-len 256 --output-len 128 --ignore-eos --concurrency 16 --num-requests 64
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from dataclasses import fields
from importlib.util import find_spec
from pathlib import Path

from services.bench.config import (
    DEFAULT_NUM_REQUESTS,
    DEFAULT_URLS,
    BenchConfig,
    BenchConfigError,
    Target,
    backend_named,
    parse_priority_mix,
)


def register(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser(
        "bench",
        help="measure servers (tandem, or OpenAI-compatible) under load, side by side",
        description="Send one workload to each target in turn (tandem's gRPC API or an "
        "OpenAI-compatible HTTP server) and print throughput and TTFT / inter-token / end-to-end "
        "latency percentiles in one table. Repeat --backend/--url to compare servers.",
    )
    target = bench.add_argument_group("targets")
    target.add_argument(
        "--backend",
        action="append",
        choices=("tandem", "openai"),
        help="tandem (gRPC) or openai (HTTP); repeat with --url for several targets (default "
        "tandem)",
    )
    target.add_argument(
        "--url",
        action="append",
        help=f"HOST:PORT for tandem (default {DEFAULT_URLS['tandem']}), http://HOST:PORT for "
        f"openai (default {DEFAULT_URLS['openai']}); one per --backend",
    )
    target.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default="completions",
        help="openai: /v1/completions or /v1/chat/completions (chat also sends tandem the "
        "prompt as a chat message, so both apply the chat template)",
    )
    target.add_argument(
        "--api-key",
        default=os.environ.get("TANDEM_API_KEY", "").split(",")[0] or None,
        help="sent to every target as a Bearer token (default: $TANDEM_API_KEY)",
    )
    target.add_argument(
        "--model",
        help="openai: the model name to send (default: the first that GET /v1/models lists)",
    )

    load = bench.add_argument_group("workload")
    load.add_argument(
        "--dataset",
        choices=("random", "chat"),
        default="random",
        help="random: prompts of --prompt-len one-token words; chat: built-in chat prompts",
    )
    load.add_argument("--prompt-len", type=int, default=256, help="prompt tokens (default 256)")
    load.add_argument("--output-len", type=int, default=128, help="max tokens (default 128)")
    load.add_argument(
        "--random-range",
        type=float,
        default=0.0,
        metavar="R",
        help="draw each length uniformly from [n·(1−R), n·(1+R)] (default 0: fixed)",
    )
    load.add_argument(
        "--concurrency", type=int, help="requests in flight (default 1); with --rate, a cap on them"
    )
    load.add_argument("--rate", type=float, help="Poisson arrivals, requests per second")
    load.add_argument(
        "--priority-mix",
        type=_priority_mix,
        default=((0, 1.0),),
        metavar="P:W,...",
        help='tandem only: priorities and their weights, e.g. "0:0.9,10:0.1"',
    )
    load.add_argument("--ignore-eos", action="store_true", help="generate all --output-len tokens")
    load.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    load.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the workload's seed (default 0); the same seed sends the same prompts, so a "
        "server that kept them in its prefix cache skips their prefill: change it between runs",
    )
    stop = load.add_mutually_exclusive_group()
    stop.add_argument("--duration", type=float, help="seconds to keep sending")
    stop.add_argument(
        "--num-requests", type=int, help=f"measured requests (default {DEFAULT_NUM_REQUESTS})"
    )
    load.add_argument("--warmup", type=int, default=0, help="requests sent first, not measured")
    load.add_argument(
        "--timeout", type=float, default=600.0, help="seconds per request (default 600)"
    )

    out = bench.add_argument_group("output")
    out.add_argument("--json", type=Path, metavar="PATH", help="per-request records and summary")
    out.add_argument("--plot", type=Path, metavar="PATH.png", help="latency CDFs, throughput")
    out.add_argument("--no-progress", action="store_true", help="no live progress bar")
    bench.set_defaults(func=_bench)


def _priority_mix(text: str) -> tuple[tuple[int, float], ...]:
    try:
        return parse_priority_mix(text)
    except BenchConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    names = [backend_named(b) for b in args.backend or ["tandem"]]
    urls = args.url or [DEFAULT_URLS[b] for b in names]
    if len(urls) != len(names):
        raise BenchConfigError(
            f"give one --url per --backend ({len(names)} backends, {len(urls)} urls)"
        )
    targets = tuple(Target(b, u) for b, u in zip(names, urls, strict=True))
    # The workload flags are named as BenchConfig's fields.
    values = {f.name: getattr(args, f.name) for f in fields(BenchConfig) if f.name in vars(args)}
    values.update(api_key=args.api_key or None, progress=not args.no_progress)
    return BenchConfig(targets=targets, **values)


def _bench(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        openai = any(t.backend == "openai" for t in config.targets)
        needs = {"httpx": openai, "matplotlib": args.plot}
        if missing := [name for name, needed in needs.items() if needed and not find_spec(name)]:
            need = " and ".join(missing)
            raise BenchConfigError(f"this run needs {need}: pip install 'tandem[bench]'")
    except BenchConfigError as err:
        print(f"tandem bench: error: {err}", file=sys.stderr)
        return 2
    # Imported here: matplotlib and httpx load only when a benchmark really runs.
    from services.bench.report import table, write_json
    from services.bench.runner import run

    runs = asyncio.run(run(config))
    print(table(runs))
    if args.json:
        write_json(args.json, config, runs)
        print(f"records and summary: {args.json}", file=sys.stderr)
    if args.plot:
        from services.bench.plot import write_plot

        write_plot(args.plot, runs)
        print(f"plot: {args.plot}", file=sys.stderr)
    # Failures are results (an overloaded server refuses some); only a target that answered
    # nothing at all makes the exit status say so.
    return 1 if any(not any(r.ok for r in run.measured) for run in runs) else 0
