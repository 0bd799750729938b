"""One hop between two processes: the shm ring against gRPC aio unary and gRPC aio streaming.

    python -m bench.shm_transport [--quick] [--json PATH] [--sizes 64,4096,...] [--spin-us 50]

Every transport runs ping-pong with an echo process: the client sends a payload, the peer sends
the same amount back, and one-way latency is half the round trip (both sides use the same
clock-free path, so no cross-process clock is needed). Throughput is payload / mean one-way
time with one message in flight: the hop as the per-step pipeline sees it, not a pipelined
stream.

shm path per size: up to INLINE_MAX bytes the record itself carries the payload (one copy in,
one copy out). Above it, the payload lives in the sender's arena region, the ring carries its
~70-byte handle, and the receiver validates it and takes a zero-copy view (the "hand-off"; the
sender touches the first 8 bytes each round, the receiver reads them back). The "+copy" column
is the same hand-off where the receiver also copies the whole region out.

Timings, not assertions: the machine is shared, so numbers are noisy. Prints one table and,
with --json, writes {"results": [{"transport", "payload_bytes", "p50_us", "p99_us",
"gbytes_per_s"}, ...]} with transport "shm", "grpc_unary" or "grpc_stream".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from multiprocessing.connection import Connection
from pathlib import Path

import grpc
import posix_ipc

from shm.arena import Arena
from shm.consumer import RingConsumer
from shm.handle import Handle
from shm.producer import RingProducer
from shm.reader import Reader

SIZES = (64, 4096, 64 << 10, 1 << 20, 16 << 20)
INLINE_MAX = 4096
ARENA_BYTES = 64 << 20
RING_BYTES = 1 << 20
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
]
INLINE, HANDLE, COPY, QUIT = b"I", b"H", b"C", b"Q"
COUNTER = struct.Struct("<Q")


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(transport: str, size: int, one_way_s: list[float]) -> dict[str, float | int | str]:
    mean = statistics.fmean(one_way_s)
    return {
        "transport": transport,
        "payload_bytes": size,
        "p50_us": round(percentile(one_way_s, 0.50) * 1e6, 2),
        "p99_us": round(percentile(one_way_s, 0.99) * 1e6, 2),
        "gbytes_per_s": round(size / mean / 1e9, 4),
    }


class Budget:
    """How many round trips to time: until `seconds` pass, within [least, most]."""

    def __init__(self, seconds: float, least: int, most: int) -> None:
        self.seconds, self.least, self.most = seconds, least, most

    def run(self, round_trip: Callable[[], None], warmup: int = 20) -> list[float]:
        for _ in range(warmup):
            round_trip()
        samples: list[float] = []
        stop = time.perf_counter() + self.seconds
        while len(samples) < self.most and (
            len(samples) < self.least or time.perf_counter() < stop
        ):
            start = time.perf_counter_ns()
            round_trip()
            samples.append((time.perf_counter_ns() - start) / 2e9)
        return samples


# --- shm ------------------------------------------------------------------------------------


class ShmEnd:
    """One side of the shm ping-pong: an outgoing ring, an arena, and a reader for the peer's."""

    def __init__(self, spin_s: float) -> None:
        self.out = RingProducer.create(RING_BYTES, spin_s=spin_s)
        self.arena = Arena.create(ARENA_BYTES)
        self.reader = Reader()
        self.regions: dict[int, Handle] = {}
        self.spin_s = spin_s
        self.inbox: RingConsumer | None = None

    def attach(self, name: str) -> RingConsumer:
        self.inbox = RingConsumer.attach(name, spin_s=self.spin_s)
        return self.inbox

    def region(self, size: int) -> Handle:
        if size not in self.regions:
            handle = self.arena.alloc((size,), "uint8")
            self.arena.view(handle)[...] = 7  # fault the pages in once, as a live pipeline has
            self.regions[size] = handle
        return self.regions[size]

    def send_handle(self, kind: bytes, size: int, counter: int) -> None:
        handle = self.region(size)
        self.arena.view(handle)[:8] = memoryview(COUNTER.pack(counter))
        self.out.put(kind + handle.to_bytes())

    def take_handle(self, record: bytes) -> tuple[int, int]:
        """Resolve the peer's handle (copying the region out for COPY): (nbytes, counter)."""
        handle = Handle.from_bytes(record[1:])
        data = self.reader.copy(handle) if record[:1] == COPY else self.reader.view(handle)
        return handle.nbytes, int(COUNTER.unpack(data[:8].tobytes())[0])

    def close(self) -> None:
        if self.inbox is not None:
            self.inbox.close()
        self.reader.close()
        self.regions.clear()
        self.arena.close()
        self.out.close()


def shm_peer(client_ring: str, conn: Connection, spin_s: float) -> None:
    end = ShmEnd(spin_s)
    inbox = end.attach(client_ring)
    conn.send(end.out.name)
    while True:
        record = inbox.get()
        kind = record[:1]
        if kind == QUIT:
            break
        if kind == INLINE:
            end.out.put(record)
        else:
            end.send_handle(kind, *end.take_handle(record))
    conn.recv()  # the client has detached
    end.close()


def bench_shm(sizes: list[int], budget: Budget, spin_s: float) -> tuple[list[dict], dict]:
    ctx = mp.get_context("spawn")
    end = ShmEnd(spin_s)
    conn, child_conn = ctx.Pipe()
    peer = ctx.Process(target=shm_peer, args=(end.out.name, child_conn, spin_s))
    peer.start()
    inbox = end.attach(conn.recv())
    results, copies = [], {}
    counter = 0

    def handoff(kind: bytes, size: int) -> Callable[[], None]:
        def round_trip() -> None:
            nonlocal counter
            counter += 1
            end.send_handle(kind, size, counter)
            if end.take_handle(inbox.get())[1] != counter:
                raise RuntimeError("shm peer answered out of turn")

        return round_trip

    for size in sizes:
        if size <= INLINE_MAX:
            record = INLINE + bytes(size)

            def inline(record: bytes = record) -> None:
                end.out.put(record)
                if len(inbox.get()) != len(record):
                    raise RuntimeError("shm peer answered out of turn")

            results.append(summarize("shm", size, budget.run(inline)))
        else:
            results.append(summarize("shm", size, budget.run(handoff(HANDLE, size))))
            copies[size] = summarize("shm+copy", size, budget.run(handoff(COPY, size)))
    end.out.put(QUIT)
    inbox.close()
    end.inbox = None
    conn.send("detached")
    peer.join()
    end.close()
    return results, copies


# --- gRPC -----------------------------------------------------------------------------------


def grpc_peer(conn: Connection) -> None:
    async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    async def stream(
        requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        async for request in requests:
            yield request

    async def serve() -> None:
        server = grpc.aio.server(options=GRPC_OPTIONS)
        handler = grpc.method_handlers_generic_handler(
            "bench.Echo",
            {
                "Unary": grpc.unary_unary_rpc_method_handler(unary),
                "Stream": grpc.stream_stream_rpc_method_handler(stream),
            },
        )
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        conn.send(port)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        await server.stop(0)

    asyncio.run(serve())


async def _grpc_client(port: int, sizes: list[int], budget: Budget) -> list[dict]:
    results = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) as channel:
        unary = channel.unary_unary("/bench.Echo/Unary")
        for size in sizes:
            payload = bytes(size)

            async def call_once(payload: bytes = payload) -> object:
                return await unary(payload)

            samples = await _timed(budget, call_once)
            results.append(summarize("grpc_unary", size, samples))
        for size in sizes:
            payload = bytes(size)
            call = channel.stream_stream("/bench.Echo/Stream")()

            async def bounce(
                payload: bytes = payload, call: grpc.aio.StreamStreamCall = call
            ) -> object:
                await call.write(payload)
                return await call.read()

            samples = await _timed(budget, bounce)
            await call.done_writing()
            results.append(summarize("grpc_stream", size, samples))
    return results


async def _timed(budget: Budget, round_trip: Callable[[], Awaitable[object]]) -> list[float]:
    for _ in range(20):
        await round_trip()
    samples: list[float] = []
    stop = time.perf_counter() + budget.seconds
    while len(samples) < budget.most and (
        len(samples) < budget.least or time.perf_counter() < stop
    ):
        start = time.perf_counter_ns()
        await round_trip()
        samples.append((time.perf_counter_ns() - start) / 2e9)
    return samples


def bench_grpc(sizes: list[int], budget: Budget) -> list[dict]:
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    peer = ctx.Process(target=grpc_peer, args=(child_conn,))
    peer.start()
    try:
        return asyncio.run(_grpc_client(conn.recv(), sizes, budget))
    finally:
        conn.send("stop")
        peer.join()


def bench_pinned_h2d(sizes: list[int], budget: Budget) -> list[str]:
    """Host-to-device copies from an arena region: pageable, then page-locked (cudaHostRegister)."""
    import torch

    from shm.pinned import pin, unpin

    lines = []
    with Arena.create(max(sizes) * 2) as arena:
        for size in sizes:
            handle = arena.alloc((size,), "uint8")
            host = torch.from_numpy(arena.view(handle))
            host.fill_(1)
            device = torch.empty(size, dtype=torch.uint8, device="cuda")
            rates = []
            for pinned in (False, True):
                if pinned:
                    pin(arena.segment)

                def copy(host: torch.Tensor = host, device: torch.Tensor = device) -> None:
                    device.copy_(host, non_blocking=True)
                    torch.cuda.synchronize()

                samples = budget.run(copy, warmup=3)  # each sample is half a copy's time
                rates.append(size / (2 * statistics.median(samples)) / 1e9)
            unpin(arena.segment)
            lines.append(
                f"H2D from shm, {human(size)}: pageable {rates[0]:.1f} GB/s, "
                f"page-locked {rates[1]:.1f} GB/s"
            )
            del host
            arena.free(handle)
    return lines


# --- report ---------------------------------------------------------------------------------


def semaphore_peer(names: tuple[str, str], rounds: int) -> None:
    ping, pong = (posix_ipc.Semaphore(n) for n in names)
    for _ in range(rounds):
        ping.acquire()
        pong.release()


def bench_semaphore(budget: Budget) -> dict:
    """The floor under any wake-up: a bare posix-semaphore ping-pong, no ring, no payload."""
    names = (f"/tandem-bench-{os.getpid()}-ping", f"/tandem-bench-{os.getpid()}-pong")
    ping, pong = (posix_ipc.Semaphore(n, posix_ipc.O_CREX, mode=0o600) for n in names)
    rounds = 20 + budget.most
    ctx = mp.get_context("spawn")
    peer = ctx.Process(target=semaphore_peer, args=(names, rounds))
    peer.start()
    try:

        def round_trip() -> None:
            ping.release()
            pong.acquire()

        samples = budget.run(round_trip)
        for _ in range(rounds - 20 - len(samples)):
            round_trip()
        peer.join()
    finally:
        for sem in (ping, pong):
            sem.unlink()
            sem.close()
    return summarize("bare semaphore ping-pong", 0, samples)


def bench_shm_async(budget: Budget, spin_s: float) -> dict:
    """The 64-byte hop where the client awaits `get_async` on an event loop (the services' way)."""
    ctx = mp.get_context("spawn")
    end = ShmEnd(spin_s)
    conn, child_conn = ctx.Pipe()
    peer = ctx.Process(target=shm_peer, args=(end.out.name, child_conn, spin_s))
    peer.start()
    inbox = end.attach(conn.recv())
    record = INLINE + bytes(64)

    async def measure() -> list[float]:
        async def round_trip() -> None:
            end.out.put(record)
            await inbox.get_async()

        return await _timed(budget, round_trip)

    samples = asyncio.run(measure())
    end.out.put(QUIT)
    inbox.close()
    end.inbox = None
    conn.send("detached")
    peer.join()
    end.close()
    return summarize("shm get_async", 64, samples)


def human(size: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def table(results: list[dict], copies: dict[int, dict], extra: list[dict]) -> str:
    by = {(r["transport"], r["payload_bytes"]): r for r in results}
    sizes = sorted({r["payload_bytes"] for r in results})
    head = (
        "| payload | shm p50 / p99 µs | shm GB/s | shm+copy p50 µs | grpc unary p50 / p99 µs "
        "| unary GB/s | grpc stream p50 / p99 µs | stream GB/s | unary÷shm p50 | stream÷shm p50 |"
    )
    lines = [head, "|" + "---|" * 10]
    for size in sizes:
        shm, unary, stream = (by.get((t, size)) for t in ("shm", "grpc_unary", "grpc_stream"))
        if shm is None or unary is None or stream is None:
            continue
        copy = copies.get(size)
        copy_cell = f"{copy['p50_us']:.1f} ({copy['gbytes_per_s']:.1f} GB/s)" if copy else "inline"
        lines.append(
            f"| {human(size)} | {shm['p50_us']:.1f} / {shm['p99_us']:.1f} "
            f"| {shm['gbytes_per_s']:.3g} | {copy_cell} "
            f"| {unary['p50_us']:.1f} / {unary['p99_us']:.1f} | {unary['gbytes_per_s']:.3g} "
            f"| {stream['p50_us']:.1f} / {stream['p99_us']:.1f} | {stream['gbytes_per_s']:.3g} "
            f"| {unary['p50_us'] / shm['p50_us']:.0f}× | {stream['p50_us'] / shm['p50_us']:.0f}× |"
        )
    for row in extra:
        lines.append(
            f"\n{row['transport']}, {human(row['payload_bytes'])} one-way: "
            f"p50 {row['p50_us']:.1f} µs, p99 {row['p99_us']:.1f} µs"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (fewer round trips)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="payload bytes")
    parser.add_argument("--spin-us", type=float, default=None, help="ring spin before sleeping")
    parser.add_argument(
        "--cuda",
        action="store_true",
        help="also time host-to-device copies from shm, pinned or not",
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    budget = Budget(0.4, 10, 3000) if args.quick else Budget(2.0, 30, 20000)
    from shm.ring import DEFAULT_SPIN_S

    spin_s = DEFAULT_SPIN_S if args.spin_us is None else args.spin_us * 1e-6
    shm_results, copies = bench_shm(sizes, budget, spin_s)
    extra = [bench_semaphore(budget)]
    if 64 in sizes:
        extra.append(bench_shm_async(budget, spin_s))
    grpc_results = bench_grpc(sizes, budget)
    results = shm_results + grpc_results
    print(table(results, copies, extra))
    if args.cuda:
        for line in bench_pinned_h2d([16 << 20, 256 << 20], budget):
            print(line)
    if args.json:
        args.json.write_text(json.dumps({"results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
