"""What holding output to a form costs a decode step, in the engine alone (no servers): the
median step of N sequences free and held to any JSON object, in alternating rounds, on the
CPU or a GPU. `bench/structured.py` runs it beside its servers; on a GPU run it alone."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from bench.cli import first_paragraph, json_option, tandem_home
from engine import registry

MODES = ("free", "json_object")


def engine_steps(
    model: Path,
    rows: list[int],
    steps: int,
    rounds: int,
    device: str = "cpu",
    kv_cache_mb: int = 512,
) -> dict[int, dict[str, list[float]]]:
    """Per row count, each mode's median decode-step ms in each round."""
    from engine.batch import FROM_LAST_STEP, SeqInput
    from engine.engine import Engine
    from engine.guided import OutputFormat, compile_format, grammar_tokenizer
    from engine.sampling_params import SamplingParams
    from engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model)
    dtype = "float32" if device == "cpu" else "bfloat16"
    engine = Engine.from_path(
        model, device, dtype, kv_cache_bytes=kv_cache_mb << 20, progress=False
    )
    vocabulary = grammar_tokenizer(tokenizer, tokenizer.vocab_size)
    grammar = compile_format(OutputFormat("json_object"), vocabulary)
    ids = tokenizer.encode_chat([{"role": "user", "content": "Describe a person as JSON."}])
    per_seq = -(-(len(ids) + steps + 1) // engine.block_size)

    def run(n: int, params: SamplingParams) -> float:
        tables = [list(range(r * per_seq, (r + 1) * per_seq)) for r in range(n)]
        engine.step([SeqInput(r, ids, 0, tables[r], params, prompt_len=len(ids)) for r in range(n)])
        times = []
        for i in range(steps):
            batch = [
                SeqInput(r, [FROM_LAST_STEP], len(ids) + i, tables[r], params, prompt_len=len(ids))
                for r in range(n)
            ]
            started = time.perf_counter()
            engine.step(batch)
            times.append(time.perf_counter() - started)
        engine.release(list(range(n)))
        return 1000 * statistics.median(times)

    out: dict[int, dict[str, list[float]]] = {}
    for n in rows:
        out[n] = {mode: [] for mode in MODES}
        for r in range(rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                held = grammar if mode == "json_object" else ""
                out[n][mode].append(run(n, SamplingParams(temperature=0, grammar=held)))
    return out


def table(steps: dict[int, dict[str, list[float]]]) -> str:
    lines = [
        "| sequences | free (ms) | held to a JSON object (ms) | cost |",
        "|---:|---:|---:|---:|",
    ]
    for n, modes in steps.items():
        free, held = (statistics.median(modes[m]) for m in MODES)
        lines.append(f"| {n} | {free:.2f} | {held:.2f} | {held / free - 1:+.1%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=first_paragraph(__doc__))
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--model", default=registry.DEFAULT_MODEL, help="a registry name")
    parser.add_argument("--kv-cache-mb", type=int, default=512)
    parser.add_argument(
        "--rows", type=int, nargs="+", default=[16], help="sequences of a decode step"
    )
    parser.add_argument("--steps", type=int, default=48, help="decode steps a round times")
    parser.add_argument("--rounds", type=int, default=4)
    json_option(parser, "RESULTS-guided-steps.json")
    args = parser.parse_args(argv)
    model = registry.fetch_any(registry.lookup(args.model), tandem_home(), quiet=True)
    steps = engine_steps(model, args.rows, args.steps, args.rounds, args.device, args.kv_cache_mb)
    print(table(steps))
    args.json.write_text(
        json.dumps({"device": args.device, "model": args.model, "steps": steps}, indent=1) + "\n"
    )
    print(f"results: {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
