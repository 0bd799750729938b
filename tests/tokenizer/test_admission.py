"""The tokenizer's admission path in this process, against a scheduler stub whose answers the test
holds back: what it does when a caller goes away while its Submit is on the way, and with a
request id already in flight; and that long texts are (de)tokenized off the event loop. The
prompt arena is a real one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from engine.errors import InvalidRequest
from engine.tokenizer import Tokenizer, load_tokenizer
from services.telemetry.tracing import Tracing
from services.tokenizer.admission import Admission
from services.tokenizer.metrics import TokenizerMetrics
from services.tokenizer.request import parse_generate
from services.tokenizer.scheduler_link import SchedulerLink
from services.tokenizer.service import GenerationServicer
from services.tokenizer.telemetry import TokenizerTelemetry
from shm.arena import Arena
from tandem.internal.v1 import hotpath_pb2 as hp
from tandem.internal.v1 import scheduler_pb2 as spb
from tandem.v1 import generation_pb2 as pb

WAIT_S = 10.0
MODEL = "m"


class HeldScheduler:
    """Submit waits until the test lets it answer; Cancel is recorded."""

    def __init__(self) -> None:
        self.submitted = asyncio.Event()
        self.answer = asyncio.Event()
        self.cancelled: list[str] = []
        self.cancel_seen = asyncio.Event()

    async def Submit(self, request: spb.SubmitRequest, **kw: object) -> spb.SubmitResponse:
        self.submitted.set()
        await self.answer.wait()
        return spb.SubmitResponse()

    async def Cancel(self, request: spb.CancelRequest, **kw: object) -> spb.CancelResponse:
        self.cancelled.append(request.request_id)
        self.cancel_seen.set()
        return spb.CancelResponse(found=True)


@pytest.fixture(scope="module")
def tokenizer(default_gguf: Path) -> Tokenizer:
    return load_tokenizer(default_gguf)


@pytest.fixture
def arena() -> Iterator[Arena]:
    with Arena.create(1 << 20) as arena:
        yield arena


def admission_for(
    tokenizer: Tokenizer, scheduler: HeldScheduler, arena: Arena
) -> tuple[Admission, SchedulerLink]:
    link = SchedulerLink(scheduler, "scheduler", "tok-1", arena)  # type: ignore[arg-type]
    link.model = hp.ModelDescription(max_seq_len=2048, vocab_size=tokenizer.vocab_size)
    link.attached.set()
    telemetry = TokenizerTelemetry(Tracing.off(), TokenizerMetrics(MODEL), MODEL)
    return Admission(tokenizer, MODEL, link, arena, telemetry), link


def generate(
    admission: Admission, request_id: str
) -> contextlib.aclosing[AsyncIterator[pb.GenerateResponse]]:
    request = pb.GenerateRequest(text="Hello there", max_tokens=8, request_id=request_id)
    spec = parse_generate(request, MODEL, admission.tokenizer.vocab_size, admission.max_seq_len)
    call = admission.telemetry.begin(None)
    return contextlib.aclosing(admission.generate(spec, call, None))


async def test_a_caller_gone_while_its_submit_is_on_the_way_is_cancelled_in_the_scheduler(
    tokenizer: Tokenizer, arena: Arena
) -> None:
    scheduler = HeldScheduler()
    admission, link = admission_for(tokenizer, scheduler, arena)
    empty = arena.free_bytes

    async def first_reply() -> None:
        async with generate(admission, "r1") as replies:
            await anext(replies)

    call = asyncio.create_task(first_reply())
    async with asyncio.timeout(WAIT_S):
        await scheduler.submitted.wait()
    call.cancel()  # the caller goes away
    with pytest.raises(asyncio.CancelledError):
        await call
    # The scheduler may have the request already: its prompt must outlive the call.
    assert arena.free_bytes < empty
    scheduler.answer.set()  # it did
    async with asyncio.timeout(WAIT_S):
        await scheduler.cancel_seen.wait()
    assert scheduler.cancelled == ["r1"]
    assert arena.free_bytes < empty  # until the scheduler reports the request's end
    link.dispatch(
        hp.EventBatch(requests=[hp.RequestEvents(request_id="r1", finish_reason="cancelled")])
    )
    assert arena.free_bytes == empty


async def test_a_request_id_already_in_flight_is_refused_and_the_first_goes_on(
    tokenizer: Tokenizer, arena: Arena
) -> None:
    scheduler = HeldScheduler()
    scheduler.answer.set()
    admission, link = admission_for(tokenizer, scheduler, arena)
    empty = arena.free_bytes
    async with generate(admission, "same") as first:
        await anext(first)
        with pytest.raises(InvalidRequest, match="request_id"):
            async with generate(admission, "same") as second:
                await anext(second)
        link.dispatch(
            hp.EventBatch(requests=[hp.RequestEvents(request_id="same", finish_reason="length")])
        )
        async with asyncio.timeout(WAIT_S):
            last = await anext(first)
    assert last.finish_reason == "length"
    assert arena.free_bytes == empty


async def test_a_request_id_whose_prompt_is_still_held_is_refused(
    tokenizer: Tokenizer, arena: Arena
) -> None:
    # The first caller went away and its Cancel is on the way: until the scheduler reports the
    # request's end, its prompt is filed under its id.
    scheduler = HeldScheduler()
    scheduler.answer.set()
    admission, link = admission_for(tokenizer, scheduler, arena)
    async with generate(admission, "gone") as first:
        await anext(first)
    async with asyncio.timeout(WAIT_S):
        await scheduler.cancel_seen.wait()
    with pytest.raises(InvalidRequest, match="already in flight"):
        async with generate(admission, "gone") as second:
            await anext(second)
    link.dispatch(
        hp.EventBatch(requests=[hp.RequestEvents(request_id="gone", finish_reason="cancelled")])
    )
    async with generate(admission, "gone") as third:
        assert (await anext(third)).request_id == "gone"


async def test_a_long_text_is_tokenized_and_detokenized_off_the_event_loop(
    tokenizer: Tokenizer, arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    admission, _ = admission_for(tokenizer, HeldScheduler(), arena)
    servicer = GenerationServicer(admission)
    loop_ran = threading.Event()
    waited: list[bool] = []

    def waiting_for_the_loop(work: Callable[..., object]) -> Callable[..., object]:
        def wrapped(*args: object, **kwargs: object) -> object:
            # On a thread the loop runs meanwhile and lets it go; on the loop it waits in vain.
            waited.append(loop_ran.wait(WAIT_S))
            return work(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(tokenizer, "encode_prompt", waiting_for_the_loop(tokenizer.encode_prompt))
    monkeypatch.setattr(tokenizer, "decode", waiting_for_the_loop(tokenizer.decode))
    loop = asyncio.get_running_loop()
    loop.call_soon(loop_ran.set)
    text = "lorem ipsum dolor sit amet " * 400
    ids = (await servicer.Tokenize(pb.TokenizeRequest(text=text), None)).token_ids  # type: ignore[arg-type]
    loop_ran.clear()
    loop.call_soon(loop_ran.set)
    many = pb.DetokenizeRequest(token_ids=list(ids) * 2)
    back = (await servicer.Detokenize(many, None)).text  # type: ignore[arg-type]
    assert waited == [True, True]
    assert len(ids) > 1000 and back == text * 2


async def test_a_chats_tools_reach_the_chat_template(
    tokenizer: Tokenizer, arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    admission, _ = admission_for(tokenizer, HeldScheduler(), arena)
    servicer = GenerationServicer(admission)
    seen: list[object] = []
    encode_chat = tokenizer.encode_chat

    def watched(messages: object, *args: object, tools: object = None, **kwargs: object) -> object:
        seen.append(tools)
        return encode_chat(messages, *args, tools=tools, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tokenizer, "encode_chat", watched)
    tools = [{"type": "function", "function": {"name": "clock"}}]
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])
    chat.tools = json.dumps(tools)
    await servicer.Tokenize(pb.TokenizeRequest(chat=chat), None)  # type: ignore[arg-type]
    chat.tools = ""
    await servicer.Tokenize(pb.TokenizeRequest(chat=chat), None)  # type: ignore[arg-type]
    assert seen == [tools, None]
    chat.tools = '{"not": "a list"}'
    with pytest.raises(InvalidRequest, match=r"prompt\.chat\.tools: must be a JSON list"):
        await servicer.Tokenize(pb.TokenizeRequest(chat=chat), None)  # type: ignore[arg-type]


async def test_a_truncated_prompt_runs_its_last_tokens_after_its_bos(
    llama3: Tokenizer, arena: Arena
) -> None:
    """truncate_prompt_tokens: the prompt's last tokens, the beginning of sequence kept first (as
    a tokenizer that truncates keeps it); -1 fits the context; without it, too long is refused
    with the way out named."""
    admission, _ = admission_for(llama3, HeldScheduler(), arena)

    async def run(text: str, keep: int) -> list[int]:
        request = pb.GenerateRequest(text=text, truncate_prompt_tokens=keep)
        spec = parse_generate(request, MODEL, llama3.vocab_size, admission.max_seq_len)
        return await admission._tokenize(spec)

    text = "one two three four five six seven eight"
    ids = llama3.encode_prompt(text, allow_special=True)
    bos = ids[0]
    assert bos == llama3.bos_token_id and len(ids) == 9
    assert await run(text, 4) == [bos, *ids[-3:]]
    assert await run(text, 1) == ids[-1:]
    assert await run(text, 100) == await run(text, 0) == ids
    long = "lorem ipsum dolor sit amet " * 500
    fitted = await run(long, -1)
    assert len(fitted) == admission.max_seq_len - 1 and fitted[0] == bos
    assert fitted[1:] == llama3.encode_prompt(long, allow_special=True)[-len(fitted) + 1 :]
    with pytest.raises(InvalidRequest, match=r"do not fit .*truncate_prompt_tokens"):
        await run(long, 0)
