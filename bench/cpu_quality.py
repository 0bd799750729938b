"""How far each CPU weight format's logits move from the fp32 dequantized model (default model).

    python -m bench.cpu_quality [--model NAME_OR_PATH] [--json PATH]

The same prompts go through each format twice: as one prefill (many rows) and one token at a time
(single-row decode steps), since a format may take a different kernel for each.
Each row's logits are compared with the fp32 reference's at the same position: max relative
error, top-1 agreement and KL divergence. Prints a table and writes JSON.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:
    sys.exit("run this benchmark as a module: python -m bench.cpu_quality")

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from engine import registry
from engine.batch import SeqInput
from engine.engine import Engine
from engine.tokenizer import load_tokenizer

PROMPTS = [
    [{"role": "user", "content": "Explain how a rainbow forms, and why the sky is blue."}],
    [{"role": "user", "content": "Write a Python function that checks if a number is prime."}],
    [{"role": "user", "content": "Quelle est la capitale de l'Australie, et pourquoi ?"}],
]


def logits(engine: Engine, ids: list[int], one_at_a_time: bool) -> torch.Tensor:
    """(len(ids), vocab) fp32 logits of every position, through prefill or decode steps."""
    table = list(range(-(-len(ids) // engine.block_size)))
    if not one_at_a_time:
        return engine.model.logits(engine.forward([SeqInput("q", ids, 0, table)]))
    rows = [
        engine.model.logits(engine.forward([SeqInput("q", [t], p, table)]))
        for p, t in enumerate(ids)
    ]
    return torch.cat(rows)


def compare(ours: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    return {
        "max_relative_error": float((ours - ref).abs().max() / ref.abs().max()),
        "top1_agreement": float((ours.argmax(-1) == ref.argmax(-1)).float().mean()),
        "kl_nats_per_token": float(
            F.kl_div(
                ours.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="batchmean"
            )
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=registry.DEFAULT_MODEL)
    parser.add_argument("--json", type=Path, default=Path("bench/cpu_quality.json"))
    args = parser.parse_args()
    home = Path(os.environ.get("TANDEM_HOME", "~/.cache/tandem")).expanduser()
    path = registry.resolve(args.model, home)
    tokenizer = load_tokenizer(path)
    prompts = [tokenizer.encode_chat(m) for m in PROMPTS]
    engines = {
        quantize: Engine.from_path(
            path, "cpu", "float32", 64 << 20, progress=False, quantize=quantize
        )
        for quantize in ("none", "auto", "int4", "int8")
    }
    engines["bfloat16"] = Engine.from_path(
        path, "cpu", "bfloat16", 64 << 20, progress=False, quantize="none"
    )
    with torch.inference_mode():
        reference = torch.cat([logits(engines["none"], ids, False) for ids in prompts])
        rows = []
        for name, engine in engines.items():
            if name == "none":
                continue
            for one_at_a_time in (False, True):
                ours = torch.cat([logits(engine, ids, one_at_a_time) for ids in prompts])
                path_name = "decode steps (1 row)" if one_at_a_time else "prefill (many rows)"
                rows.append(
                    {
                        "format": f"quantize={name}" if name != "bfloat16" else "dtype=bfloat16",
                        "linear_format": engine.loaded.linear_format,
                        "path": path_name,
                        **compare(ours, reference),
                    }
                )
    print(f"\n{path.name}: logits of {reference.shape[0]} positions against fp32 dequantized")
    print(f"{'format':<16} {'served as':<22} {'path':<22} {'max rel':>8} {'top-1':>7} {'KL':>8}")
    for r in rows:
        print(
            f"{r['format']:<16} {r['linear_format']:<22} {r['path']:<22} "
            f"{r['max_relative_error']:>8.3f} {r['top1_agreement']:>7.1%} "
            f"{r['kl_nats_per_token']:>8.4f}"
        )
    args.json.write_text(json.dumps({"model": path.name, "rows": rows}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
