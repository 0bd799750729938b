"""`tandem perplexity` beside llama.cpp's `llama-perplexity` on the same GGUF and text, and
transformers computing the same measure in fp32: the perplexity each gets, and how fast.

    python -m bench.perplexity --llama-perplexity PATH [--file TEXT] [--ctx 512] [--json PATH]

The measure (engine/perplexity.py): windows of --ctx tokens, each beginning with BOS where the
model's prompts do, the second half of each scored given what precedes it in the window.
`tandem` runs as a user would type it (`tandem perplexity`, its default weight format) and in
fp32 with dequantized weights (`--dtype float32 --quantize none`); llama-perplexity with 2
threads (`-t 2`, this machine's cores); transformers (`AutoModelForCausalLM` on the same GGUF,
dequantized to fp32) in this process, four windows a batch. Seconds are those of the scoring
(each tool's own count, model loading left out); they run one at a time.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:
    sys.exit("run this benchmark as a module: python -m bench.perplexity")

import argparse
import json
import math
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from bench.cli import first_paragraph, json_option, tandem_home
from engine import registry
from engine.perplexity import windows
from engine.tokenizer import load_tokenizer

DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")  # on every Debian: 35 KB of English


def tandem(model: Path, text: Path, ctx: int, *flags: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "services.cli", "perplexity", "--model", str(model)]
    cmd += ["--file", str(text), "--ctx", str(ctx), "--json", *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    out = json.loads(done.stdout)
    return {"perplexity": out["perplexity"], "error": out["error"], "seconds": out["seconds"]}


def llama_perplexity(binary: str, model: Path, text: Path, ctx: int) -> dict[str, Any]:
    cmd = [binary, "-m", str(model), "-f", str(text), "-c", str(ctx), "-t", "2"]
    log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    final = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
    # Its log lines begin with the time since start (minutes.seconds.ms.us; the final estimate's
    # may follow the progress line without a line break): scoring is from the line announcing it
    # to the final estimate.
    stamp = r"(\d+)\.(\d+)\.(\d+)\.(\d+) I "
    begun = re.search(stamp + r"perplexity: calculating perplexity", log)
    ended = re.search(stamp + r"Final estimate", log)
    if final is None or begun is None or ended is None:
        raise RuntimeError(f"llama-perplexity printed no estimate:\n{log[-2000:]}")

    def seconds(m: re.Match[str]) -> float:
        minutes, secs, ms, us = (int(g) for g in m.groups())
        return minutes * 60 + secs + ms / 1e3 + us / 1e6

    spent = seconds(ended) - seconds(begun)
    return {"perplexity": float(final.group(1)), "error": float(final.group(2)), "seconds": spent}


def transformers_fp32(model: Path, text: Path, ctx: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(model)
    ids = tokenizer.encode_prompt(text.read_text(encoding="utf-8"), allow_special=False)
    bos = tokenizer.bos_token_id if tokenizer.add_bos else None
    hf = AutoModelForCausalLM.from_pretrained(
        model.parent, gguf_file=model.name, dtype=torch.float32
    ).eval()
    chunks = windows(ids, ctx, bos)
    nll: list[float] = []
    started = time.perf_counter()
    with torch.no_grad():
        for a in range(0, len(chunks), 4):
            batch = torch.tensor(chunks[a : a + 4])
            logprobs = torch.log_softmax(hf(batch).logits.float(), dim=-1)
            for row, window in zip(logprobs, batch.tolist(), strict=True):
                nll += [-float(row[p - 1, window[p]]) for p in range(ctx // 2 + 1, ctx)]
    spent = time.perf_counter() - started
    mean = math.fsum(nll) / len(nll)
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in nll) / (len(nll) - 1))
    ppl = math.exp(mean)
    return {"perplexity": ppl, "error": ppl * sd / math.sqrt(len(nll)), "seconds": spent}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=first_paragraph(__doc__))
    parser.add_argument("--llama-perplexity", required=True, help="llama.cpp's binary")
    parser.add_argument("--model", default=registry.DEFAULT_MODEL, help="a name or a GGUF path")
    parser.add_argument("--file", type=Path, default=DEFAULT_TEXT, help="the text")
    parser.add_argument("--ctx", type=int, default=512)
    json_option(parser, "RESULTS-perplexity.json")
    args = parser.parse_args(argv)
    model = registry.resolve(args.model, tandem_home())
    tokens = len(load_tokenizer(model).encode_prompt(args.file.read_text(), allow_special=False))
    scored_tokens = tokens // args.ctx * args.ctx  # whole windows, each prefilled whole
    runs = {
        "tandem (as it starts)": lambda: tandem(model, args.file, args.ctx),
        "llama-perplexity": lambda: llama_perplexity(
            args.llama_perplexity, model, args.file, args.ctx
        ),
        "tandem fp32": lambda: tandem(
            model, args.file, args.ctx, "--dtype", "float32", "--quantize", "none"
        ),
        "transformers fp32": lambda: transformers_fp32(model, args.file, args.ctx),
    }
    rows = []
    for name, measure in runs.items():
        row = {"case": name, **measure()}
        row["tokens_per_s"] = scored_tokens / row["seconds"]
        rows.append(row)
        print(
            f"{name}: {row['perplexity']:.4f} ± {row['error']:.4f}, {row['seconds']:.2f} s",
            flush=True,
        )
    print(f"\n{args.file} ({tokens} tokens), windows of {args.ctx}, {model.name}")
    print(f"{'case':24} {'perplexity':>18} {'seconds':>8} {'tokens/s':>9}")
    for row in rows:
        ppl = f"{row['perplexity']:.4f} ± {row['error']:.4f}"
        print(f"{row['case']:24} {ppl:>18} {row['seconds']:8.2f} {row['tokens_per_s']:9.0f}")
    report = {"model": model.name, "text": str(args.file), "tokens": tokens, "ctx": args.ctx}
    args.json.write_text(json.dumps({**report, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
