"""Scoring texts through tandem's HTTP API, as evaluation harnesses ask a server (completions with
`echo`, `logprobs: 1`, `max_tokens: 1`, token ids), beside transformers scoring the same texts in
this process: the same answers, and how fast.

    python -m bench.scoring [--concurrency 1 4 16] [--json PATH]

The task is multiple choice, in lm-evaluation-harness's loglikelihood form: each question's
context, followed by each of its choices; the choice whose tokens have the highest summed
logprob is the answer. Both sides score the default model's GGUF in fp32 with dequantized
weights (`--dtype float32 --quantize none`), so their logprobs agree to rounding; `tandem
(default)` is the server as it starts with no flags (its weight format, its threads), the one a
user would evaluate. transformers runs one request at a time (as lm-evaluation-harness's `hf`
model does with batch size 1) and in padded batches of 16. Servers and transformers run one at a
time: on a shared 2-core machine they would slow each other.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:
    sys.exit("run this benchmark as a module: python -m bench.scoring")

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from bench.cli import first_paragraph, json_option, tandem_home
from engine import registry
from engine.tokenizer import Tokenizer, load_tokenizer
from harness.pipeline import pipeline

CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Japan", "Tokyo"), ("China", "Beijing"), ("Russia", "Moscow"), ("Egypt", "Cairo"),
    ("Canada", "Ottawa"), ("Australia", "Canberra"), ("Brazil", "Brasilia"),
    ("India", "New Delhi"), ("Greece", "Athens"), ("Portugal", "Lisbon"), ("Norway", "Oslo"),
    ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Poland", "Warsaw"),
    ("Austria", "Vienna"), ("Ireland", "Dublin"), ("Kenya", "Nairobi"), ("Peru", "Lima"),
    ("Chile", "Santiago"), ("Cuba", "Havana"), ("Turkey", "Ankara"), ("Thailand", "Bangkok"),
    ("Vietnam", "Hanoi"), ("Argentina", "Buenos Aires"), ("Mexico", "Mexico City"),
    ("Belgium", "Brussels"),
]  # fmt: skip
FP32 = ("--dtype", "float32", "--quantize", "none")


def task(tokenizer: Tokenizer) -> list[tuple[list[int], list[list[int]], int]]:
    """(context ids, each choice's ids, the right choice) per question: four choices, the
    others three other capitals, the right one at a different place each time."""
    capitals = [c for _, c in CAPITALS]
    out = []
    for i, (country, capital) in enumerate(CAPITALS):
        choices = [capital, *(capitals[(i + k) % len(capitals)] for k in (3, 7, 11))]
        choices = choices[i % 4 :] + choices[: i % 4]
        context = f"Question: What is the capital of {country}?\nAnswer:"
        ids = tokenizer.encode_prompt(context, allow_special=False)
        continuations = [tokenizer.encode(f" {c}", allow_special=False) for c in choices]
        out.append((ids, continuations, choices.index(capital)))
    return out


def requests_of(questions: list[tuple[list[int], list[list[int]], int]]) -> list[tuple[int, int]]:
    """(question, choice) of every loglikelihood request, in order."""
    return [(q, c) for q, (_, choices, _) in enumerate(questions) for c in range(len(choices))]


async def score_http(
    url: str,
    questions: list[tuple[list[int], list[list[int]], int]],
    concurrency: int,
    scored: bool = True,
) -> tuple[dict[tuple[int, int], float], float]:
    """Each request's continuation logprob (as lm-evaluation-harness sums them), and seconds.
    scored False: the same requests without echo (one token generated, nothing scored), what
    scoring costs beside."""
    todo = requests_of(questions)
    out: dict[tuple[int, int], float] = {}
    limit = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, q: int, c: int) -> None:
        context, choices, _ = questions[q]
        body = {
            "model": "",
            "prompt": context + choices[c],
            "echo": scored,
            "logprobs": 1 if scored else None,
            "max_tokens": 1,
            "temperature": 0,
            "seed": 1234,
        }
        async with limit:
            reply = await client.post(f"{url}/completions", json=body)
        reply.raise_for_status()
        if scored:
            token_logprobs = reply.json()["choices"][0]["logprobs"]["token_logprobs"]
            out[q, c] = sum(token_logprobs[len(context) : -1])

    async with httpx.AsyncClient(timeout=600) as client:
        await one(client, *todo[0])  # a first request, outside the timing
        started = time.perf_counter()
        await asyncio.gather(*(one(client, q, c) for q, c in todo))
        return out, time.perf_counter() - started


def score_transformers(
    model: Any, questions: list[tuple[list[int], list[list[int]], int]], batch: int
) -> tuple[dict[tuple[int, int], float], float]:
    todo = requests_of(questions)
    out: dict[tuple[int, int], float] = {}
    started = time.perf_counter()
    with torch.no_grad():
        for a in range(0, len(todo), batch):
            part = todo[a : a + batch]
            rows = [questions[q][0] + questions[q][1][c] for q, c in part]
            width = max(map(len, rows))
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            mask = torch.zeros(len(rows), width, dtype=torch.long)
            for r, row in enumerate(rows):  # right-padded: positions stay those of one row
                ids[r, : len(row)] = torch.tensor(row)
                mask[r, : len(row)] = 1
            logprobs = torch.log_softmax(model(ids, attention_mask=mask).logits.float(), dim=-1)
            for r, (q, c) in enumerate(part):
                n = len(questions[q][0])
                row = rows[r]
                out[q, c] = sum(float(logprobs[r, p - 1, row[p]]) for p in range(n, len(row)))
    return out, time.perf_counter() - started


def accuracy(
    questions: list[tuple[list[int], list[list[int]], int]], scores: dict[tuple[int, int], float]
) -> tuple[float, list[int]]:
    picks = []
    for q, (_, choices, _) in enumerate(questions):
        picks.append(max(range(len(choices)), key=lambda c: scores[q, c]))
    right = sum(p == questions[q][2] for q, p in enumerate(picks))
    return right / len(questions), picks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=first_paragraph(__doc__))
    parser.add_argument("--model", default=registry.DEFAULT_MODEL, help="a name or a GGUF path")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    json_option(parser, "RESULTS-scoring.json")
    args = parser.parse_args(argv)
    path = registry.resolve(args.model, tandem_home())
    tokenizer = load_tokenizer(path)
    questions = task(tokenizer)
    n_requests = len(requests_of(questions))
    tokens = sum(len(c) + len(x) for c, xs, _ in questions for x in xs)
    rows: list[dict[str, Any]] = []
    controls: list[dict[str, Any]] = []  # the same requests, unscored
    scores: dict[str, dict[tuple[int, int], float]] = {}
    with tempfile.TemporaryDirectory() as logs:
        for label, flags in (("tandem fp32", FP32), ("tandem (default)", ())):
            with pipeline(Path(logs), "--model", str(path), *flags) as running:
                for concurrency in args.concurrency:
                    got, seconds = asyncio.run(score_http(running.http_url, questions, concurrency))
                    name = f"{label}, {concurrency} at once"
                    scores[name] = got
                    rows.append({"case": name, "seconds": seconds})
                    print(f"{name}: {seconds:.2f} s", flush=True)
                most = max(args.concurrency)
                _, seconds = asyncio.run(score_http(running.http_url, questions, most, False))
                controls.append(
                    {"case": f"{label}, {most} at once, not scored", "seconds": seconds}
                )
                print(f"{controls[-1]['case']}: {seconds:.2f} s", flush=True)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    for batch in (1, 16):
        name = f"transformers fp32, batch {batch}"
        got, seconds = score_transformers(model, questions, batch)
        scores[name] = got
        rows.append({"case": name, "seconds": seconds})
        print(f"{name}: {seconds:.2f} s", flush=True)
    reference = scores["transformers fp32, batch 1"]
    _, reference_picks = accuracy(questions, reference)
    for row in rows:
        got = scores[row["case"]]
        acc, picks = accuracy(questions, got)
        row.update(
            requests_per_s=n_requests / row["seconds"],
            tokens_per_s=tokens / row["seconds"],
            accuracy=acc,
            same_picks=sum(a == b for a, b in zip(picks, reference_picks, strict=True)),
            max_abs_diff=max(abs(got[k] - reference[k]) for k in reference),
        )
    for row in controls:
        row.update(requests_per_s=n_requests / row["seconds"], tokens_per_s=tokens / row["seconds"])
    print(f"\n{len(questions)} questions, {n_requests} loglikelihood requests, {tokens} tokens")
    print(f"{'case':36} {'req/s':>7} {'tok/s':>8} {'acc':>6} {'same picks':>10} {'max |Δ|':>9}")
    for row in rows:
        print(
            f"{row['case']:36} {row['requests_per_s']:7.1f} {row['tokens_per_s']:8.0f} "
            f"{row['accuracy']:6.3f} {row['same_picks']:>6}/{len(questions)} "
            f"{row['max_abs_diff']:9.2e}"
        )
    for row in controls:
        print(f"{row['case']:36} {row['requests_per_s']:7.1f} {row['tokens_per_s']:8.0f}")
    args.json.write_text(
        json.dumps(
            {
                "model": str(path.name),
                "questions": len(questions),
                "tokens": tokens,
                "rows": rows,
                "unscored": controls,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
