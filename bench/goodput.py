"""Goodput through the pipeline: the highest Poisson arrival rate (`tandem bench --rate`) that
holds TTFT p99 ≤ 500 ms and ITL p99 ≤ 50 ms, as vLLM and SGLang publish it.

    python -m bench.goodput [--model llama3-8b-random] [--device cuda] [--duration 15]

Two workloads: prompt 512 / output 256, and a chat-like mix (prompt 400, output 200, each length
drawn uniformly within ±90%). For each, the rate grows by half from where it starts until one
misses the SLO, then the bracket between the last rate held and the first missed is halved. Each
rate sends about `--duration` seconds of arrivals, so the high rates reach a steady state.
Near the knee one run of a rate can read twice another's tail: `--repeats N` runs each rate N
times and counts it held when most runs hold it. `--compare FLAGS` runs the whole search again
on a fresh pipeline with more flags, in the same run (an A/B on one machine; cards differ).
Prints one line a run and each setting's brackets; writes every run's summary as JSON.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:
    sys.exit("run this module as: python -m bench.goodput")

import argparse
import json
import shlex
import tempfile
import urllib.request
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from bench.cli import first_paragraph, json_option, write_json
from harness.pipeline import pipeline
from services.cli import main as tandem

TTFT_P99_S, ITL_P99_S = 0.5, 0.05
# Each workload's flags and the rate its search starts from (req/s).
WORKLOADS = {
    "512/256": (["--prompt-len", "512", "--output-len", "256"], 12.0),
    "chat-like mix": (
        ["--prompt-len", "400", "--output-len", "200", "--random-range", "0.9"],
        12.0,
    ),
}


# The server's own view of the tail, beside the client's: the share of inter-token gaps the
# tokenizer saw, of steps the worker ran, and of the worker's launches of steps carrying prefill,
# longer than each bound (histogram buckets). Name -> (process, family, its labels to match).
SERVER_TAILS = {
    "gaps": ("tokenizer-1", "tandem_inter_token_latency_seconds", {}),
    "steps": ("worker", "tandem_step_duration_seconds", {}),
    "prefill launches": ("worker", "tandem_step_launch_seconds", {"kind": "prefill"}),
}
TAIL_BOUNDS_S = (0.025, 0.05)


def bucket_counts(url: str, family: str, labels: dict[str, str]) -> dict[float, float]:
    """A histogram's cumulative bucket counts, by upper bound, as the process serves them now."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    counts: dict[float, float] = {}
    for metric in text_string_to_metric_families(text):
        for sample in metric.samples:
            if sample.name == f"{family}_bucket" and labels.items() <= sample.labels.items():
                counts[float(sample.labels["le"])] = sample.value
    return counts


def tail_shares(metrics: dict[str, str]) -> Callable[[], dict[str, float]]:
    """Reads the histograms now; the returned call reads them again and gives, for each and
    each bound, the share of the observations between the two reads above that bound."""

    def read() -> dict[str, dict[float, float]]:
        return {
            name: bucket_counts(metrics[process], family, labels)
            for name, (process, family, labels) in SERVER_TAILS.items()
        }

    before = read()

    def shares() -> dict[str, float]:
        out = {}
        for name, after in read().items():
            seen = after.get(float("inf"), 0.0) - before[name].get(float("inf"), 0.0)
            for bound in TAIL_BOUNDS_S:
                within = after.get(bound, 0.0) - before[name].get(bound, 0.0)
                out[f"{name} > {bound * 1000:g} ms"] = (seen - within) / seen if seen else 0.0
        return out

    return shares


class Sweep:
    """Runs `tandem bench --rate` against one pipeline. Each run of a pipeline sends other
    prompts (the scheduler's prefix cache outlives a run), and the same run of another pipeline
    the same ones at the same times: the seed is the workload's, the rate's and the repeat's."""

    def __init__(
        self,
        address: str,
        metrics: dict[str, str],
        log_dir: Path,
        duration_s: float,
        min_requests: int,
    ):
        self.address, self.metrics, self.log_dir = address, metrics, log_dir
        self.duration_s, self.min_requests = duration_s, min_requests
        self.results: list[dict[str, Any]] = []

    def holds(self, name: str, shape: list[str], rate: float, repeats: int = 1) -> bool:
        """Whether most of `repeats` runs of this rate held the SLO (stops once that is known)."""
        held = missed = 0
        while 2 * held <= repeats and 2 * missed < repeats:
            if self.run(name, shape, rate, held + missed):
                held += 1
            else:
                missed += 1
        return 2 * held > repeats

    def run(self, name: str, shape: list[str], rate: float, repeat: int = 0) -> bool:
        """One run of a rate; whether it held the SLO."""
        seed = zlib.crc32(f"{name}|{rate}|{repeat}".encode())
        out = self.log_dir / f"run{len(self.results)}.json"
        # Arrivals span about duration_s at every rate, so a high rate reaches a steady state.
        requests = max(self.min_requests, round(rate * self.duration_s))
        load = ["--rate", str(rate), "--num-requests", str(requests), "--warmup", "2"]
        load += ["--ignore-eos", "--seed", str(seed), "--no-progress", "--json", str(out)]
        server_tails = tail_shares(self.metrics)
        tandem(["bench", "--backend", "tandem", "--url", self.address, *shape, *load])
        tails = server_tails()
        summary = json.loads(out.read_text())["runs"][0]["summary"][0]
        ttft, itl = summary["ttft_s"]["p99"], summary["itl_s"]["p99"]
        ok = ttft <= TTFT_P99_S and itl <= ITL_P99_S and not summary["failed"]
        self.results.append(
            {
                "workload": name,
                "rate": rate,
                "repeat": repeat,
                "seed": seed,
                "requests": requests,
                "meets_slo": ok,
                "summary": summary,
                "server_tail_shares": tails,
            }
        )
        print(
            f"{name:<14} {rate:>5.1f} req/s ({requests} requests): "
            f"{summary['request_throughput']:5.2f} req/s done, "
            f"{summary['output_throughput']:7.0f} tok/s, TTFT p99 {ttft * 1000:6.0f} ms, "
            f"ITL p99 {itl * 1000:5.1f} ms {'meets' if ok else 'misses'} the SLO; "
            + ", ".join(f"{k} {v:.2%}" for k, v in tails.items()),
            flush=True,
        )
        return ok

    def search(
        self,
        name: str,
        shape: list[str],
        start: float,
        max_rate: float,
        bisections: int,
        repeats: int = 1,
    ) -> tuple[float, float | None]:
        """The highest rate found to hold the SLO, and the lowest found to miss it (None if
        every rate up to max_rate held): rates grow by half until one misses, then the bracket
        is halved `bisections` times."""
        held, missed = 0.0, None
        rate = start
        while rate <= max_rate:
            if self.holds(name, shape, rate, repeats):
                held, rate = rate, round(rate * 1.5, 1)
            else:
                missed = rate
                break
        for _ in range(bisections if missed is not None else 0):
            rate = round((held + missed) / 2, 1)  # type: ignore[operator]
            if rate in (held, missed):
                break
            if self.holds(name, shape, rate, repeats):
                held = rate
            else:
                missed = rate
        return held, missed


def main() -> None:
    parser = argparse.ArgumentParser(description=first_paragraph(__doc__))
    parser.add_argument("--model", default="llama3-8b-random")
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--duration", type=float, default=15.0, help="seconds of arrivals at each rate"
    )
    parser.add_argument("--min-requests", type=int, default=64, help="measured requests a rate")
    parser.add_argument("--max-rate", type=float, default=64.0, help="req/s the search stops at")
    parser.add_argument(
        "--bisections", type=int, default=2, help="halvings of the held/missed bracket"
    )
    parser.add_argument("--start", type=float, help="req/s to start from (default per workload)")
    parser.add_argument(
        "--serve-args",
        default="",
        help="more flags for the pipeline, e.g. '--max-num-batched-tokens 1024'",
    )
    parser.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="FLAGS",
        help="the search again on a fresh pipeline with these flags added (repeatable), "
        'e.g. --compare="--backlog-batched-tokens 0"',
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs of each rate; held when most hold it"
    )
    parser.add_argument(
        "--workload", choices=sorted(WORKLOADS), action="append", help="only these (default: all)"
    )
    json_option(parser, "goodput.json")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    flags = ["--model", args.model, "--device", args.device, "--max-num-seqs", "256"]
    if args.device == "cuda":
        flags += ["--dtype", "bfloat16", "--kv-cache-mb", "40000", "--ready-timeout", "600"]
    flags += shlex.split(args.serve_args)
    settings = {args.serve_args or "as given": flags}
    settings |= {extra: flags + shlex.split(extra) for extra in args.compare}
    found: dict[str, dict[str, tuple[float, float | None]]] = {}
    results: list[dict[str, Any]] = []
    for setting, serve_flags in settings.items():
        log_dir = Path(tempfile.mkdtemp(prefix="tandem-goodput-"))
        with pipeline(log_dir, *serve_flags) as served:
            sweep = Sweep(served.address, served.metrics, log_dir, args.duration, args.min_requests)
            for name in args.workload or WORKLOADS:
                shape, start = WORKLOADS[name]
                found.setdefault(setting, {})[name] = sweep.search(
                    name, shape, args.start or start, args.max_rate, args.bisections, args.repeats
                )
        results += [{"setting": setting, **run} for run in sweep.results]
    for setting, brackets in found.items():
        for name, (held, missed) in brackets.items():
            above = f"{missed} req/s missed it" if missed is not None else "no rate tried missed it"
            print(f"goodput {name} [{setting}]: {held} req/s held the SLO; {above}")
    write_json(
        args.json,
        {
            "found": {
                setting: {k: {"held": h, "missed": m} for k, (h, m) in brackets.items()}
                for setting, brackets in found.items()
            },
            "repeats": args.repeats,
            "runs": results,
        },
    )


if __name__ == "__main__":
    main()
