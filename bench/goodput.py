"""Goodput through the pipeline: Poisson arrivals at increasing rates (`tandem bench --rate`),
and the highest rate that holds TTFT p99 ≤ 500 ms and ITL p99 ≤ 50 ms, as vLLM and SGLang
publish it.

    python -m bench.goodput [--model llama3-8b-random] [--device cuda] [--requests 64]

Two workloads: prompt 512 / output 256, and a chat-like mix (prompt 400, output 200, each length
drawn uniformly within ±90%). Every run sends other prompts (another seed): the scheduler's
prefix cache outlives a run. Prints one line a run and the goodput of each workload.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:
    sys.exit("run this module as: python -m bench.goodput")

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from harness.pipeline import pipeline
from services.cli import main as tandem

TTFT_P99_S, ITL_P99_S = 0.5, 0.05
WORKLOADS = {
    "512/256": (["--prompt-len", "512", "--output-len", "256"], (4, 8, 12, 16)),
    "chat-like mix": (
        ["--prompt-len", "400", "--output-len", "200", "--random-range", "0.9"],
        (6, 12, 18),
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama3-8b-random")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--requests", type=int, default=64, help="measured requests a rate")
    parser.add_argument(
        "--json", type=Path, default=Path(os.environ.get("OUT", "bench")) / "goodput.json"
    )
    args = parser.parse_args()
    flags = ["--model", args.model, "--device", args.device, "--max-num-seqs", "256"]
    if args.device == "cuda":
        flags += ["--dtype", "bfloat16", "--kv-cache-mb", "40000", "--ready-timeout", "600"]
    log_dir = Path(tempfile.mkdtemp(prefix="tandem-goodput-"))
    results: list[dict[str, Any]] = []
    seed = 100
    with pipeline(log_dir, *flags) as served:
        for name, (shape, rates) in WORKLOADS.items():
            for rate in rates:
                seed += 1
                out = log_dir / f"run{seed}.json"
                load = ["--rate", str(rate), "--num-requests", str(args.requests), "--warmup", "2"]
                load += ["--ignore-eos", "--seed", str(seed), "--no-progress", "--json", str(out)]
                tandem(["bench", "--backend", "tandem", "--url", served.address, *shape, *load])
                summary = json.loads(out.read_text())["runs"][0]["summary"][0]
                ttft, itl = summary["ttft_s"]["p99"], summary["itl_s"]["p99"]
                ok = ttft <= TTFT_P99_S and itl <= ITL_P99_S and not summary["failed"]
                results.append(
                    {"workload": name, "rate": rate, "meets_slo": ok, "summary": summary}
                )
                print(
                    f"{name:<14} {rate:>5.1f} req/s: {summary['request_throughput']:5.2f} req/s "
                    f"done, {summary['output_throughput']:7.0f} tok/s, TTFT p99 "
                    f"{ttft * 1000:6.0f} ms, ITL p99 {itl * 1000:5.1f} ms "
                    f"{'meets' if ok else 'misses'} the SLO",
                    flush=True,
                )
    for name in WORKLOADS:
        held = [r["rate"] for r in results if r["workload"] == name and r["meets_slo"]]
        print(f"goodput {name}: {max(held) if held else 0} req/s (of the rates tried)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
