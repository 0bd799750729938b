"""Does the GPU hold the matmul rate the floors use? The SM clock, power and clock-event reasons
(`nvidia-smi`, sampled every 50 ms) while it runs: the 14 ms burst of 8192³ products that
bench.gpu calls the matmul rate, the same product held for 8 s, and the TTFT of a 2,048-token
prompt (random weights of the LLaMA-3-8B shapes) one second apart and back to back.

    python -m bench.power_limit [--json PATH] [--seconds 8]

Prints a table of each phase and writes the samples and timings as JSON.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:
    sys.exit("run this benchmark as a module: python -m bench.power_limit")

import argparse
import json
import statistics
import time
from typing import Any

import torch

from bench.cli import first_paragraph, json_option, tandem_home
from bench.gpu_clock import parse_samples, sampling, summarize
from bench.gpu_measure import held_matmul_rates, matmul_rate, ttft
from engine import registry
from engine.engine import Engine


def main() -> None:
    parser = argparse.ArgumentParser(description=first_paragraph(__doc__))
    json_option(parser, "power_limit.json")
    parser.add_argument("--seconds", type=float, default=8.0, help="how long the rate is held")
    args = parser.parse_args()
    home = tandem_home()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    log = args.json.with_suffix(".csv")
    phases: list[tuple[str, float, float, str]] = []
    result: dict[str, Any] = {"device": torch.cuda.get_device_name()}
    with sampling(log):
        start = time.time()
        result["burst_tflops"] = [matmul_rate() / 1e12 for _ in range(3)]
        phases.append(("8192³ burst (bench.gpu's rate)", start, time.time(), "TFLOP/s"))
        time.sleep(2.0)
        start = time.time()
        result["held_tflops"] = [r / 1e12 for r in held_matmul_rates(args.seconds)]
        phases.append((f"8192³ held {args.seconds:.0f} s", start, time.time(), "TFLOP/s"))
        engine = Engine.from_path(
            registry.resolve("llama3-8b-random", home),
            "cuda",
            "bfloat16",
            kv_cache_bytes=8 << 30,
            progress=False,
        )
        time.sleep(2.0)
        for key, label, rest, repeats in (
            ("ttft_idle_ms", "TTFT 2,048, 1 s apart", 1.0, 6),
            ("ttft_back_to_back_ms", "TTFT 2,048, back to back", 0.0, 60),
        ):
            start = time.time()
            result[key] = [t * 1000 for t in ttft(engine, 2048, repeats, rest)]
            phases.append((label, start, time.time(), "ms"))
    samples = parse_samples(log.read_text().splitlines())
    values = [result["burst_tflops"], result["held_tflops"]]
    values += [result["ttft_idle_ms"], result["ttft_back_to_back_ms"]]
    print(f"{result['device']}; nvidia-smi every 50 ms (its power is an average: it lags bursts)")
    print(f"{'phase':<32} {'median':>8} {'unit':<8} clock and power")
    result["phases"] = []
    for (label, start, end, unit), v in zip(phases, values, strict=True):
        shown = summarize(samples, start, end)
        print(f"{label:<32} {statistics.median(v):8.1f} {unit:<8} {shown}")
        result["phases"].append({"phase": label, "median": statistics.median(v), "unit": unit,
                                 "start": start, "end": end, "clock_and_power": shown})  # fmt: skip
    result["samples"] = samples
    args.json.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
