"""How far each weight format's and KV cache dtype's logits move from a float reference
(default model).

    python -m bench.quality [--device cpu|cuda] [--model NAME_OR_PATH] [--json PATH]

On CPU the formats are CPU's (auto, int4, int8, bf16, fp8, an fp8 KV cache) against the fp32
dequantized model; on CUDA they are the GPU's (int8, fp8, an fp8 KV cache, both) against bf16,
and bf16 itself against fp32. The same prompts go through each format twice: as one prefill
(many rows) and one token at a time (single-row decode steps, which read every earlier K and V
back from the cache), since a format may take a different kernel for each. Each row's logits are
compared with the reference's at the same position: max relative error, top-1 agreement and KL
divergence. Prints a table and writes JSON.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:
    sys.exit("run this benchmark as a module: python -m bench.quality")

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.cli import first_paragraph, tandem_home
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


# (name, dtype, quantize, kv_cache_dtype) of each format; the first is the reference.
FORMATS = {
    "cpu": [
        ("fp32", "float32", "none", "auto"),
        ("quantize=auto", "float32", "auto", "auto"),
        ("quantize=int4", "float32", "int4", "auto"),
        ("quantize=int8", "float32", "int8", "auto"),
        ("quantize=fp8", "float32", "fp8", "auto"),
        ("kv-cache=fp8", "float32", "none", "fp8"),
        ("dtype=bfloat16", "bfloat16", "none", "auto"),
    ],
    "cuda": [
        ("bf16", "bfloat16", "none", "auto"),
        ("dtype=float32", "float32", "none", "auto"),
        ("quantize=int8", "bfloat16", "int8", "auto"),
        ("quantize=fp8", "bfloat16", "fp8", "auto"),
        ("kv-cache=fp8", "bfloat16", "none", "fp8"),
        ("fp8 + kv-cache=fp8", "bfloat16", "fp8", "fp8"),
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=first_paragraph(__doc__))
    parser.add_argument("--device", choices=sorted(FORMATS), default="cpu")
    parser.add_argument("--model", default=registry.DEFAULT_MODEL)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    out = args.json or Path(os.environ.get("OUT", "bench")) / f"RESULTS-quality-{args.device}.json"
    home = tandem_home()
    path = registry.resolve(args.model, home)
    tokenizer = load_tokenizer(path)
    prompts = [tokenizer.encode_chat(m) for m in PROMPTS]
    formats = FORMATS[args.device]
    reference_name = formats[0][0]
    rows = []
    with torch.inference_mode():
        reference: torch.Tensor | None = None
        for name, dtype, quantize, kv in formats:
            engine = Engine.from_path(
                path,
                args.device,
                dtype,
                64 << 20,
                progress=False,
                quantize=quantize,
                kv_cache_dtype=kv,
                warm_up_tokens=None,
            )
            for one_at_a_time in (False, True):
                ours = torch.cat([logits(engine, ids, one_at_a_time).float() for ids in prompts])
                if reference is None:
                    reference = ours  # the reference's prefill logits
                    continue
                rows.append(
                    {
                        "format": name,
                        "linear_format": engine.loaded.linear_format,
                        "kv_cache": str(engine.kv.pool.dtype).removeprefix("torch."),
                        "path": "decode steps (1 row)" if one_at_a_time else "prefill (many rows)",
                        **compare(ours, reference),
                    }
                )
            del engine
    assert reference is not None
    print(f"\n{path.name}: logits of {reference.shape[0]} positions against {reference_name}")
    print(
        f"{'format':<20} {'served as':<22} {'KV cache':<14} {'path':<22} "
        f"{'max rel':>8} {'top-1':>7} {'KL':>8}"
    )
    for r in rows:
        print(
            f"{r['format']:<20} {r['linear_format']:<22} {r['kv_cache']:<14} {r['path']:<22} "
            f"{r['max_relative_error']:>8.3f} {r['top1_agreement']:>7.1%} "
            f"{r['kl_nats_per_token']:>8.4f}"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"model": path.name, "device": args.device, "reference": reference_name, "rows": rows},
            indent=1,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
