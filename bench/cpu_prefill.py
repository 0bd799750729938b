"""Prompt prefill on the CPU with each row attended as a decode at its position (the native
`paged_prefill`, the default) against PyTorch's SDPA over the prompt's block of rows (the path
before it), side by side in one engine, alternating, on the default model.

    python -m bench.cpu_prefill [--lengths 128,512,2048] [--rounds 4] [--json PATH]

Prints the fastest of each variant's rounds, and whether the greedy token after each prompt
and its logprob are the same run whole and in two chunks (row-wise attention: always).
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.cli import first_paragraph, json_option, tandem_home, write_json
from engine import registry
from engine.batch import SeqInput
from engine.engine import Engine
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, logprobs=1)


def prefill(engine: Engine, ids: list[int], cut: int | None = None) -> tuple[float, int, float]:
    """Seconds of the prompt's forward and sample, then its greedy token and logprob; in two
    chunks (as after a cached prefix) where `cut` is given."""
    table = list(range(-(-(len(ids) + 1) // engine.block_size)))
    started = time.perf_counter()
    if cut is not None:
        engine.step([SeqInput("p", ids[:cut], 0, table, sample=False)])
    start = cut or 0
    out = engine.step([SeqInput("p", ids[start:], start, table, sampling=GREEDY)])[0]
    seconds = time.perf_counter() - started
    engine.release(["p"])
    return seconds, out.token_id, out.logprob


def main() -> None:
    parser = argparse.ArgumentParser(description=first_paragraph(__doc__))
    parser.add_argument("--model", default=registry.DEFAULT_MODEL)
    parser.add_argument("--lengths", default="128,512,2048", help="prompt lengths, in tokens")
    parser.add_argument("--rounds", type=int, default=4, help="runs of each variant and length")
    json_option(parser, "cpu_prefill.json")
    args = parser.parse_args()
    engine = Engine.from_path(registry.resolve(args.model, tandem_home()), progress=False)
    rowwise = engine.prefill_kernel
    if rowwise is None:
        raise SystemExit("row-wise prefill needs the native CPU kernels, which did not load")
    print(f"{args.model}, {torch.get_num_threads()} threads")
    print(f"{'prompt':>7} {'row-wise ms':>12} {'SDPA ms':>9} {'ratio':>6}  chunked == whole")
    rows = []
    for length in (int(n) for n in args.lengths.split(",")):
        ids = [1] + [1000 + i % 30000 for i in range(length - 1)]
        times: dict[str, list[float]] = {"row-wise": [], "sdpa": []}
        same: dict[str, bool] = {}
        for r in range(args.rounds):
            for name in ("row-wise", "sdpa") if r % 2 == 0 else ("sdpa", "row-wise"):
                engine.prefill_kernel = rowwise if name == "row-wise" else None
                seconds, token, logprob = prefill(engine, ids)
                times[name].append(seconds)
                if r == 0:
                    _, chunked_token, chunked_logprob = prefill(engine, ids, length * 3 // 5)
                    same[name] = (token, logprob) == (chunked_token, chunked_logprob)
        best = {name: min(t) for name, t in times.items()}
        print(
            f"{length:>7} {best['row-wise'] * 1e3:>12.0f} {best['sdpa'] * 1e3:>9.0f} "
            f"{best['row-wise'] / best['sdpa']:>6.2f}  row-wise {same['row-wise']}, "
            f"SDPA {same['sdpa']}",
            flush=True,
        )
        rows.append({"prompt": length, "seconds": times, "chunked_equals_whole": same})
    engine.prefill_kernel = rowwise
    write_json(
        args.json,
        {"model": args.model, "threads": torch.get_num_threads(), "rows": rows},
    )


if __name__ == "__main__":
    main()
