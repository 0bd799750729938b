"""The same workload through the engine in-process and through the three-process pipeline.

    python -m bench.pipeline [--model NAME] [--json PATH] [--quick] [--tracing]

(a) in-process: the scheduler core and the engine in one loop, no processes, no gRPC;
(b) the pipeline (`tandem serve`) with the hot path over shared-memory rings;
(c) the pipeline with the hot path over gRPC.
With --tracing, (c) gives way to (b) again with tracing on: every process exports its spans over
OTLP/gRPC to a sink in this process (which counts them), so the two shm rows show what tracing
costs; it also times, in this process, what tracing adds per step to the scheduler's loop and
to the worker's step thread (before and after the outcome is sent), by batch size. Prints
throughput, TTFT and inter-token latency p50/p99, the per-step hop scheduler → worker, and the
pipeline's throughput relative to in-process. Timings, not assertions: the machine is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import threading
import time
from concurrent import futures
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import cast

import grpc
import torch
from grpc import aio
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from bench.cli import first_paragraph, tandem_home, write_json
from engine import registry
from engine.batch import SeqInput
from engine.engine import Engine
from engine.sampling_params import GREEDY
from engine.tokenizer import load_tokenizer
from harness.pipeline import pipeline
from services.protocol import StepPlan, StepResult
from services.scheduler.config import SchedulerConfig
from services.scheduler.events import Queued, Scheduled, Token
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from tandem.internal.v1 import scheduler_pb2 as spb
from tandem.internal.v1 import scheduler_pb2_grpc
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc

TEXT = (
    "The history of computing is a story of abstraction: each layer hides the one below it, "
    "from transistors to logic gates, from instruction sets to compilers, from operating "
    "systems to the programs people use every day. "
)


@dataclass
class Timeline:
    start: float
    tokens: list[float] = field(default_factory=list)


@dataclass
class Summary:
    system: str
    concurrency: int
    requests: int
    output_tokens: int
    wall_s: float
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    hop_p50_us: float = 0.0
    hop_p99_us: float = 0.0
    spans: int = 0  # exported while it ran (traced runs only)
    # Tokens after each stream's first over the time from its first token to its last: the rate
    # a stream decodes at, which the ITL percentiles estimate less well where the stream's
    # tokens arrive unevenly around a steady rate.
    decode_tokens_per_s: float = 0.0


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(system: str, concurrency: int, lines: list[Timeline], wall: float) -> Summary:
    ttft = [(t.tokens[0] - t.start) * 1000 for t in lines if t.tokens]
    itl = [(b - a) * 1000 for t in lines for a, b in zip(t.tokens, t.tokens[1:], strict=False)]
    n = sum(len(t.tokens) for t in lines)
    streams = [t.tokens for t in lines if t.tokens]
    decoding = sum(tokens[-1] - tokens[0] for tokens in streams)
    return Summary(
        system,
        concurrency,
        len(lines),
        n,
        wall,
        n / wall,
        pct(ttft, 0.5),
        pct(ttft, 0.99),
        pct(itl, 0.5),
        pct(itl, 0.99),
        decode_tokens_per_s=(n - len(streams)) / decoding if decoding > 0 else 0.0,
    )


def in_process(
    engine: Engine, prompts: list[list[int]], out_len: int, concurrency: int, max_num_seqs: int
) -> Summary:
    core = Scheduler(
        SchedulerConfig(
            num_kv_blocks=engine.num_kv_blocks,
            block_size=engine.block_size,
            max_model_len=engine.config.max_seq_len,
            max_num_seqs=max_num_seqs,
            async_scheduling=False,  # this loop runs one plan at a time
        )
    )
    lines: dict[int, Timeline] = {}
    pending = list(enumerate(prompts))

    def admit() -> None:
        while pending and len(lines) - finished < concurrency:
            i, ids = pending.pop(0)
            lines[i] = Timeline(time.perf_counter())
            core.add_request(Request(i, ids, out_len, sampling=GREEDY))

    finished = 0
    start = time.perf_counter()
    admit()
    while core.has_unfinished():
        plan = core.schedule()
        if plan.is_empty:
            continue
        engine.release(plan.finished_seq_ids)
        outs = engine.step(
            [
                SeqInput(s.seq_id, s.token_ids, s.start_pos, s.block_table, GREEDY, s.sample)
                for s in plan.seqs
            ]
        )
        result = StepResult(
            plan.step_id, {cast(int, o.seq_id): (o.token_id, o.logprob) for o in outs}
        )
        now = time.perf_counter()
        for event in core.update(plan, result):
            if isinstance(event, Token):
                lines[event.seq_id].tokens.append(now)
        finished = sum(1 for t in lines.values() if len(t.tokens) >= out_len)
        admit()
    return summarize("in-process", concurrency, list(lines.values()), time.perf_counter() - start)


async def through_pipeline(
    address: str,
    scheduler: str,
    system: str,
    prompts: list[list[int]],
    out_len: int,
    concurrency: int,
    warm_up: bool = True,
) -> Summary:
    """`warm_up`: one short request first, not counted."""
    gate = asyncio.Semaphore(concurrency)
    lines: list[Timeline] = []

    async def one(stub: generation_pb2_grpc.GenerationStub, ids: list[int]) -> None:
        async with gate:
            line = Timeline(time.perf_counter())
            lines.append(line)
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=ids),
                max_tokens=out_len,
                ignore_eos=True,
                sampling=pb.SamplingParams(temperature=0),
            )
            async for reply in stub.Generate(request):
                now = time.perf_counter()
                line.tokens.extend([now] * len(reply.token_ids))

    async with aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        if warm_up:
            await one(stub, prompts[0][:8])
            lines.clear()
        start = time.perf_counter()
        await asyncio.gather(*(one(stub, ids) for ids in prompts))
        wall = time.perf_counter() - start
    async with aio.insecure_channel(scheduler) as channel:
        stats = await scheduler_pb2_grpc.SchedulerStub(channel).Stats(spb.StatsRequest())
    summary = summarize(system, concurrency, lines, wall)
    summary.hop_p50_us, summary.hop_p99_us = stats.hop_p50_us, stats.hop_p99_us
    return summary


def telemetry_cost(batch: int, traced: bool, steps: int = 2000) -> tuple[float, float, float]:
    """µs per step: the worker before its outcome is sent, the worker after (its flush), and the
    scheduler's loop (events, stats, plan); spans go to an exporter that drops them."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from services.scheduler.metrics import SchedulerMetrics
    from services.scheduler.state import SchedulerStats
    from services.scheduler.telemetry import SchedulerTelemetry
    from services.telemetry.config import TelemetryConfig
    from services.telemetry.tracing import Tracing
    from services.worker.metrics import WorkerMetrics
    from services.worker.telemetry import WorkerTelemetry
    from tandem.internal.v1 import hotpath_pb2 as hp

    class Drop(SpanExporter):
        def export(self, spans: object) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    tracing = Tracing.start(TelemetryConfig(service_name="bench"), Drop()) if traced else None
    worker = WorkerTelemetry(tracing, WorkerMetrics("bench"))
    scheduler = SchedulerTelemetry(tracing, SchedulerMetrics())
    scheduler.on_model("bench")
    ids = list(range(batch))
    desc = hp.StepDescriptor(seq_ids=range(batch), block_counts=[8] * batch)
    desc.num_decode_tokens = batch
    for i, rid in enumerate(ids):
        parent = f"00-{i + 1:032x}-{i + 1:016x}-01"
        desc.new_seqs.add(seq_id=i, traceparent=parent)
        scheduler.on_submit(
            rid, f"r{rid}", parent, prompt_tokens=8, max_tokens=8, priority=0, session_id=""
        )
        scheduler.on_events(
            [Queued(rid, 0.0, 1), Scheduled(rid, 0.0, 0.0, 0), Token(rid, 1, 0.0, 0)]
        )
    worker.record(desc, None, time.time_ns(), 0.0)
    worker.flush()
    del desc.new_seqs[:]
    outcome = hp.StepOutcome(seq_ids=range(batch), token_ids=[1] * batch)
    events = [Token(rid, 1, 0.0, 1) for rid in ids]
    plan = StepPlan(step_id=0, seq_ids=ids, num_decode_tokens=batch)
    stats = SchedulerStats(batch, 0, 0, 1000, 8 * batch, 1000, 0, 0, 0, 0, 0, 0, 0, 0, {})
    t0 = time.perf_counter()
    for _ in range(steps):
        worker.record(desc, outcome, time.time_ns(), 0.0)
    t1 = time.perf_counter()
    worker.flush()
    t2 = time.perf_counter()
    for _ in range(steps):
        scheduler.on_events(events)
        scheduler.on_stats(stats)
        scheduler.on_plan(plan, hp.StepDescriptor(), stats)
    t3 = time.perf_counter()
    if tracing is not None:
        tracing.shutdown()
    return tuple(x / steps * 1e6 for x in (t1 - t0, t2 - t1, t3 - t2))  # type: ignore[return-value]


class SpanSink(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace endpoint that counts the spans it is sent and keeps none."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        with self._lock:
            self.count += n
        return trace_service_pb2.ExportTraceServiceResponse()


def main() -> None:
    parser = argparse.ArgumentParser(description=first_paragraph(__doc__))
    parser.add_argument("--model", default=registry.DEFAULT_MODEL)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--scenarios", default="1x4,16x32", help="concurrency x requests, ...")
    parser.add_argument("--quick", action="store_true", help="a short run: 1x2,8x8, 16 tokens")
    parser.add_argument("--json", type=Path, default=Path("bench/pipeline.json"))
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="model threads in-process (default: all cores, the worker's default for batched "
        "steps; its small decode steps use one fewer)",
    )
    parser.add_argument(
        "--tracing", action="store_true", help="compare the shm pipeline with tracing off and on"
    )
    args = parser.parse_args()
    if args.quick:
        args.scenarios, args.output_len = "1x2,8x8", 16
    home = tandem_home()
    path = registry.resolve(args.model, home)
    tokenizer = load_tokenizer(path)
    base = tokenizer.encode(TEXT * 20, allow_special=False)
    scenarios = [tuple(int(x) for x in s.split("x")) for s in args.scenarios.split(",")]
    max_seqs = max(c for c, _ in scenarios)

    def prompts(n: int) -> list[list[int]]:
        # Distinct prompts (no prefix sharing between requests): each starts at another offset.
        return [base[i * 7 : i * 7 + args.prompt_len] for i in range(n)]

    results: list[Summary] = []
    torch.set_num_threads(args.threads)  # the same compute as the worker's, for a fair ratio
    engine = Engine.from_path(path, progress=False)
    in_process(engine, prompts(1), 4, 1, max_seqs)  # warm-up, not counted
    for c, n in scenarios:
        results.append(in_process(engine, prompts(n), args.output_len, c, max_seqs))
    del engine
    log_dir = Path(tempfile.mkdtemp(prefix="tandem-bench-"))
    sink = SpanSink() if args.tracing else None
    runs = [("shm", False), ("shm", True)] if args.tracing else [("shm", False), ("grpc", False)]
    for transport, traced in runs:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink.port}"} if sink else {}
        if not traced:
            env = {"OTEL_SDK_DISABLED": "true"}  # off even where the shell configured it
        with pipeline(
            log_dir,
            "--model",
            args.model,
            "--max-num-seqs",
            str(max_seqs),
            "--transport",
            transport,
            env=env,
        ) as served:
            for c, n in scenarios:
                before = sink.count if sink else 0
                summary = asyncio.run(
                    through_pipeline(
                        served.address,
                        served.scheduler_address,
                        f"pipeline ({transport}{', traced' if traced else ' hop'})",
                        prompts(n),
                        args.output_len,
                        c,
                    )
                )
                if sink is not None and traced:
                    # Spans leave within the batch processor's delay (5 s): count them, untimed.
                    time.sleep(6.0)
                    summary.spans = sink.count - before
                results.append(summary)

    print(
        f"\n{path.name}: prompt {args.prompt_len} tokens, output {args.output_len}, CPU "
        f"threads {os.cpu_count()}"
    )
    header = (
        f"{'system':<22} {'conc':>4} {'req':>4} {'tok/s':>8} {'vs in-proc':>10} "
        f"{'TTFT p50':>9} {'p99':>7} {'ITL p50':>8} {'p99':>7} {'hop p50':>9} {'p99 µs':>7}"
        + (f" {'spans':>6}" if args.tracing else "")
    )
    print(header)
    baseline = {r.concurrency: r.tokens_per_s for r in results if r.system == "in-process"}
    for r in results:
        ratio = r.tokens_per_s / baseline[r.concurrency]
        hop = f"{r.hop_p50_us:>9.0f} {r.hop_p99_us:>7.0f}" if r.hop_p50_us else f"{'':>9} {'':>7}"
        print(
            f"{r.system:<22} {r.concurrency:>4} {r.requests:>4} {r.tokens_per_s:>8.1f} "
            f"{ratio:>9.1%} {r.ttft_p50_ms:>7.0f}ms {r.ttft_p99_ms:>5.0f}ms "
            f"{r.itl_p50_ms:>6.1f}ms {r.itl_p99_ms:>5.1f}ms {hop}"
            + (f" {r.spans:>6}" if args.tracing else "")
        )
    write_json(
        args.json,
        {
            "model": path.name,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "results": [asdict(r) for r in results],
        },
    )
    if args.tracing:
        print("\nper-step cost of telemetry, µs (tracing off / on; spans dropped, not exported)")
        print(
            f"{'batch':>5} {'worker, before outcome':>23} {'worker, after':>15} {'scheduler':>15}"
        )
        for batch in (1, 8, 64, 256):
            off, on = telemetry_cost(batch, False), telemetry_cost(batch, True)
            cells = [f"{a:>6.1f} / {b:<6.1f}" for a, b in zip(off, on, strict=True)]
            print(f"{batch:>5} {cells[0]:>23} {cells[1]:>15} {cells[2]:>15}")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
