"""Prefill attention of a whole prompt: engine/kernels/prefill_attention.py against PyTorch's
flash attention (what engine/attention.py used before) and cuDNN's, at LLaMA-3-8B's heads
(32 query heads over 8 KV heads of 128) and SmolLM2's (9 over 3 of 64), causal, bf16.

    python -m bench.prefill_attention [--json PATH]

Each kernel is timed inside a CUDA graph; TFLOP/s count the causal half (2 · 2 · L² / 2 · hd a
head). The Triton kernel's tile choices are tried beside its default.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.cli import first_paragraph, json_option, write_json
from bench.row_tiles import graph_seconds
from engine.kernels.prefill_attention import prefill_attention

HEADS = {"8B": (32, 8, 128), "SmolLM2": (9, 3, 64)}
LENGTHS = [512, 2048, 8192]
# (BLOCK_M, BLOCK_N, warps, stages, query heads a program): PACK > 1 reads each K/V tile once
# for that many heads of a GQA group (SmolLM2's groups of 3 fall back to 1).
TILES = [(128, 64, 8, 3, 1), (128, 128, 8, 3, 1), (64, 64, 4, 3, 1), (64, 32, 4, 3, 1),
         (64, 64, 4, 3, 4), (128, 64, 8, 3, 4), (128, 64, 4, 3, 4), (128, 128, 8, 3, 4),
         (128, 64, 8, 2, 4), (128, 32, 4, 3, 4), (256, 64, 8, 3, 4), (128, 64, 8, 3, 2),
         (64, 64, 4, 3, 2)]  # fmt: skip


def sdpa(backend: SDPBackend) -> Any:
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))
        with sdpa_kernel([backend]):
            if backend == SDPBackend.CUDNN_ATTENTION:  # cuDNN takes GQA as repeated heads
                group = q4.shape[1] // k4.shape[1]
                k4, v4 = k4.repeat_interleave(group, 1), v4.repeat_interleave(group, 1)
                return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True)
            return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)

    return attend


def measure(model: str, length: int) -> list[dict[str, Any]]:
    heads, kv, hd = HEADS[model]
    torch.manual_seed(0)
    q = torch.randn(length, heads, hd, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(length, kv, hd, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(length, kv, hd, device="cuda", dtype=torch.bfloat16)
    want = sdpa(SDPBackend.MATH)(q.float(), k.float(), v.float())[0].transpose(0, 1)
    kernels: dict[str, Any] = {
        "torch flash": lambda: sdpa(SDPBackend.FLASH_ATTENTION)(q, k, v),
        "torch cuDNN": lambda: sdpa(SDPBackend.CUDNN_ATTENTION)(q, k, v),
    }
    for t in TILES:
        kernels[f"triton {t}"] = lambda t=t: prefill_attention(q, k, v, tiles=t)
    kernels["triton default"] = lambda: prefill_attention(q, k, v)
    flops = 2 * 2 * length * length / 2 * hd * heads
    rows = []
    for name, fn in kernels.items():
        try:
            seconds = graph_seconds([fn])
            got = fn()
            got = got[0].transpose(0, 1) if got.dim() == 4 else got
            err = float((got.float() - want).abs().max())
        except Exception as e:  # a tile this head size cannot take: note it, go on
            print(f"{model:<8} {length:>6} {name:<30} failed: {type(e).__name__}: {e}"[:160])
            continue
        print(f"{model:<8} {length:>6} {name:<30} {seconds * 1e6:>9.1f} "
              f"{flops / seconds / 1e12:>8.1f} {err:>8.1e}", flush=True)  # fmt: skip
        rows.append(dict(model=model, length=length, kernel=name, seconds=seconds, error=err))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=first_paragraph(__doc__))
    json_option(parser, "prefill_attention.json")
    args = parser.parse_args()
    print(torch.cuda.get_device_name())
    print(f"{'heads':<8} {'length':>6} {'kernel':<30} {'µs':>9} {'TFLOP/s':>8} {'max err':>8}")
    rows = [row for model in HEADS for length in LENGTHS for row in measure(model, length)]
    write_json(args.json, {"device": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
