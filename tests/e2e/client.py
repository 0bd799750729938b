"""What the end-to-end tests do to a running pipeline: stream, read the scheduler's books, wait.

Waits are bounded and watch for a state (a stats field, a health status), never a fixed sleep
that assumes how fast this machine is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from grpc import aio

from engine.batch import SeqInput
from engine.engine import Engine
from engine.generate import Generation, GenerationRequest, generate
from engine.sampling_params import GREEDY, SamplingParams
from engine.tokenizer import Tokenizer, load_tokenizer
from tandem.internal.v1 import scheduler_pb2 as spb
from tandem.internal.v1 import scheduler_pb2_grpc
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc

WAIT_S = 60.0  # for a state the pipeline reaches within steps; a hang fails the test after it
# For a process to start again (its model loaded): as long as the launcher lets it take.
RESTART_S = 300.0


@dataclass
class Streamed:
    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.GeneratedToken] = field(default_factory=list)
    prompt_logprobs: list[pb.PromptTokenLogprob] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    usage: pb.Usage | None = None
    messages: int = 0


async def stream(
    address: str,
    request: pb.GenerateRequest,
    timeout: float | None = None,
    on_reply: Callable[[Streamed], None] | None = None,
) -> Streamed:
    out = Streamed()
    async with aio.insecure_channel(address) as channel:
        async for reply in generation_pb2_grpc.GenerationStub(channel).Generate(
            request, timeout=timeout
        ):
            out.messages += 1
            out.prompt_ids.extend(reply.prompt_token_ids)
            out.token_ids.extend(reply.token_ids)
            out.logprobs.extend(reply.logprobs)
            out.prompt_logprobs.extend(reply.prompt_logprobs)
            out.text += reply.text
            if reply.finish_reason:
                out.finish_reason, out.usage = reply.finish_reason, reply.usage
            if on_reply is not None:
                on_reply(out)
    return out


def greedy(
    text: str = "", chat: str = "", max_tokens: int = 24, **kw: object
) -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        max_tokens=max_tokens,
        sampling=pb.SamplingParams(temperature=0),
        **kw,  # type: ignore[arg-type]
    )
    if chat:
        request.chat.messages.add(role="user", content=chat)
    else:
        request.text = text
    return request


async def scheduler_stats(address: str) -> spb.StatsResponse:
    async with aio.insecure_channel(address) as channel:
        return await scheduler_pb2_grpc.SchedulerStub(channel).Stats(spb.StatsRequest())


async def stats_when(
    address: str,
    ready: Callable[[spb.StatsResponse], bool],
    what: str,
    wait_s: float = WAIT_S,
) -> spb.StatsResponse:
    """The scheduler's stats once `ready` holds of them; TimeoutError naming `what` if never."""
    stats = None
    try:
        async with asyncio.timeout(wait_s):
            while True:
                try:
                    stats = await scheduler_stats(address)
                    if ready(stats):
                        return stats
                except aio.AioRpcError:
                    pass  # a scheduler that is restarting answers again shortly
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise TimeoutError(f"waited {wait_s:.0f} s for {what}; last stats: {stats}") from None


def idle(stats: spb.StatsResponse) -> bool:
    return stats.worker_ready and stats.running == 0 and stats.waiting == 0


class Reference:
    """The engine in this process, on the same model file and arithmetic as the worker."""

    def __init__(self, model: Path, **engine_kw: object) -> None:
        self.engine = Engine.from_path(model, kv_cache_bytes=64 << 20, progress=False, **engine_kw)  # type: ignore[arg-type]
        self.tokenizer: Tokenizer = load_tokenizer(model)

    def generate(
        self,
        ids: list[int],
        max_tokens: int,
        sampling: SamplingParams = GREEDY,
        ignore_eos: bool = False,
    ) -> Generation:
        stop = frozenset() if ignore_eos else self.tokenizer.eos_token_ids
        request = GenerationRequest(ids, sampling, max_tokens, stop_token_ids=stop)
        result = Generation()
        for _ in generate(self.engine, self.tokenizer, request, result):
            pass
        return result

    def forced(
        self, ids: list[int], tokens: list[int], sampling: SamplingParams = GREEDY
    ) -> list[list[tuple[int, float]]]:
        """The top-5 (token, logprob) at each of `tokens`' positions, `tokens` fed one by one
        after the prompt whatever the engine itself would have picked (teacher forcing).
        Logprobs are the model's own, before penalties, temperature or top-p/k."""
        engine = self.engine
        params = replace(sampling, logprobs=5)
        table = list(range(-(-(len(ids) + len(tokens)) // engine.block_size)))
        n = len(ids)
        step = SeqInput("forced", ids, 0, table, params, prompt_len=n)
        tops = []
        for i, token in enumerate(tokens):
            (out,) = engine.step([step])
            tops.append(out.top_logprobs)
            step = SeqInput("forced", [token], n + i, table, params, prompt_len=n)
        engine.release(["forced"])
        return tops
