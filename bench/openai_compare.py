"""tandem's OpenAI-compatible HTTP API under a standard load generator, beside llama.cpp's
server, and tandem's HTTP API against its gRPC API: the tables of bench/RESULTS-openai.md.

    python -m bench.openai_compare --llama-server /tmp/peers/llama-server-build/bin/llama-server \\
        --guidellm /tmp/loadgen-venv/bin/guidellm --processor /tmp/smollm2-tokenizer

1. `tandem serve` (defaults, the default model) starts; `tandem bench` sends one workload to its
   gRPC API and to its HTTP API in turn, `--rounds` times (a new seed each round, so no prompt
   is found in the prefix cache), 16 streams: HTTP's output tok/s ÷ gRPC's.
2. guidellm, unmodified from PyPI in a venv of its own (`--guidellm`), runs the same workload
   against tandem's HTTP API, then against llama.cpp's `llama-server` serving the same GGUF
   (`-t 2 -np 16 -cb -c 8192`, as bench/RESULTS-cpu.md). `--processor` is a Hugging Face
   tokenizer folder of the model (guidellm counts prompt tokens with it); one can be written
   from the GGUF with transformers: AutoTokenizer.from_pretrained(dir, gguf_file=...)
   .save_pretrained(folder).

Servers run one at a time: on a shared 2-core machine two servers would slow each other.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.cli import tandem_home
from engine import registry
from harness.pipeline import pipeline
from services.bench.config import BenchConfig, Target
from services.bench.metrics import summarize
from services.bench.runner import run
from services.launcher import free_port

WAIT_S = 300.0


def http_vs_grpc(grpc: str, http: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each round runs both APIs, in alternating order, each with prompts of its own seed: a
    prompt the other API sent first would be found in the prefix cache."""
    rounds = []
    for r in range(args.rounds):
        targets = [Target("tandem", grpc), Target("openai", http)]
        if r % 2:
            targets.reverse()
        out: dict[str, Any] = {}
        for i, target in enumerate(targets):
            config = BenchConfig(
                targets=(target,),
                prompt_len=args.prompt_len,
                output_len=args.output_len,
                ignore_eos=True,
                concurrency=args.concurrency,
                num_requests=args.num_requests,
                warmup=2,
                seed=7100 + 2 * r + i,
                progress=False,
            )
            (target_run,) = asyncio.run(run(config))
            (summary, *_) = summarize(target_run.measured, target_run.window)
            out[target.backend] = summary.to_json()
        grpc_tps = out["tandem"]["output_throughput"]
        http_tps = out["openai"]["output_throughput"]
        print(f"round {r}: gRPC {grpc_tps:.1f} tok/s, HTTP {http_tps:.1f} tok/s", flush=True)
        rounds.append(out)
    return rounds


def guidellm(url: str, model: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One guidellm run, as a user would type it; its own JSON report, read back."""
    data = f"kind=synthetic_text,prompt_tokens={args.prompt_len},output_tokens={args.output_len}"
    cmd = [
        args.guidellm, "run",
        "--backend", f"kind=openai_http,target={url},model={model}",
        "--profile", f"kind=concurrent,streams={args.concurrency}",
        "--constraint", f"kind=max_requests,count={args.num_requests}",
        "--data", data,
        "--tokenizer", f"kind=huggingface_auto,model={args.processor}",
        "--seed", "kind=static,value=7",
        "--output", f"kind=json,path={out}",
        "--disable-console-interactive",
    ]  # fmt: skip
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL)
    return dict(json.loads(out.read_text()))


def figures(report: dict[str, Any]) -> dict[str, float]:
    """What the table shows of a guidellm report: its own figures, as its console prints them."""
    (benchmark,) = report["benchmarks"]
    m = benchmark["metrics"]

    def stat(name: str, key: str) -> float:
        s = m[name]["successful"]
        return float(s["percentiles"][key] if key.startswith("p") else s[key])

    return {
        "ok": float(m["request_totals"]["successful"]),
        "errored": float(m["request_totals"]["errored"]),
        "output_tok_s": stat("output_tokens_per_second", "mean"),
        "ttft_p50_ms": stat("time_to_first_token_ms", "median"),
        "ttft_p99_ms": stat("time_to_first_token_ms", "p99"),
        "itl_p50_ms": stat("inter_token_latency_ms", "median"),
        "itl_p99_ms": stat("inter_token_latency_ms", "p99"),
        "latency_p50_s": stat("request_latency", "median"),
    }


def table(results: dict[str, Any]) -> str:
    t, llama = results["guidellm"]["tandem"], results["guidellm"]["llama.cpp"]
    rows = [
        ("requests ok / errored", "ok", "errored", None),
        ("output tok/s", "output_tok_s", None, "ratio"),
        ("TTFT p50 (ms)", "ttft_p50_ms", None, None),
        ("TTFT p99 (ms)", "ttft_p99_ms", None, None),
        ("ITL p50 (ms)", "itl_p50_ms", None, None),
        ("ITL p99 (ms)", "itl_p99_ms", None, None),
        ("request latency p50 (s)", "latency_p50_s", None, None),
    ]
    lines = [
        "| guidellm | tandem (HTTP) | llama.cpp | tandem ÷ llama.cpp |",
        "|---|---:|---:|---:|",
    ]
    for label, key, second, ratio in rows:
        if second:
            a, b = f"{t[key]:.0f} / {t[second]:.0f}", f"{llama[key]:.0f} / {llama[second]:.0f}"
        else:
            a, b = f"{t[key]:.1f}", f"{llama[key]:.1f}"
        r = f"{t[key] / llama[key]:.2f}" if ratio and llama[key] else ""
        lines.append(f"| {label} | {a} | {b} | {r} |")
    grpc = [r["tandem"]["output_throughput"] for r in results["http_vs_grpc"]]
    http = [r["openai"]["output_throughput"] for r in results["http_vs_grpc"]]
    lines += [
        "",
        "| tandem bench, 16 streams | gRPC | HTTP | HTTP ÷ gRPC |",
        "|---|---:|---:|---:|",
        *(
            f"| round {i + 1}: output tok/s | {g:.1f} | {h:.1f} | {h / g:.3f} |"
            for i, (g, h) in enumerate(zip(grpc, http, strict=True))
        ),
        f"| total | {sum(grpc):.1f} | {sum(http):.1f} | {sum(http) / sum(grpc):.3f} |",
    ]
    return "\n".join(lines)


def wait_healthy(url: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)  # a process we started and cannot await: poll its health, bounded
    raise TimeoutError(f"{url} not healthy within {WAIT_S:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--guidellm", default="guidellm")
    parser.add_argument("--processor", required=True, help="a tokenizer folder of the model")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=Path("bench/RESULTS-openai.json"))
    parser.add_argument(
        "--only-http-vs-grpc", action="store_true", help="skip guidellm and llama.cpp"
    )
    args = parser.parse_args(argv)
    gguf = registry.fetch_any(registry.lookup(registry.DEFAULT_MODEL), tandem_home(), quiet=True)
    results: dict[str, Any] = {"config": {k: str(v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with pipeline(work) as served:
            root = served.http_url.removesuffix("/v1")
            results["http_vs_grpc"] = http_vs_grpc(served.address, root, args)
            if args.only_http_vs_grpc:
                print(json.dumps(results["http_vs_grpc"], indent=1))
                return 0
            model = registry.DEFAULT_MODEL
            report = guidellm(root, model, args, work / "tandem.json")
            results["guidellm"] = {"tandem": figures(report)}
            results["guidellm_version"] = report["metadata"].get("guidellm_version", "")
        port = free_port()
        llama_cmd = [
            args.llama_server, "-m", str(gguf), "-t", "2", "-np", "16", "-cb",
            "-c", "8192", "--host", "127.0.0.1", "--port", str(port),
        ]  # fmt: skip
        llama = subprocess.Popen(
            llama_cmd,
            stdout=subprocess.DEVNULL,
            stderr=(work / "llama.log").open("w"),
        )
        try:
            wait_healthy(f"http://127.0.0.1:{port}/health")
            report = guidellm(f"http://127.0.0.1:{port}", gguf.name, args, work / "llama.json")
            results["guidellm"]["llama.cpp"] = figures(report)
        finally:
            llama.terminate()
            llama.wait(timeout=60)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    print(f"results: {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
