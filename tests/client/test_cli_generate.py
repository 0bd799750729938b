"""`tandem generate` and `tandem chat` against the fake server, run in a worker thread."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest
from fake_server import TRACE_ID, FakeServer, Script, stream

from services import cli_generate
from services.client_types import InvalidOption
from tandem.v1 import generation_pb2 as pb

PIECES = [("Paris", [42]), (" is", [7]), (".", [3])]
WAIT = 10.0


async def tandem(*argv: str) -> int:
    # The lead registers the module in services.cli; until then, a parser of our own.
    parser = argparse.ArgumentParser(prog="tandem")
    cli_generate.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(await asyncio.to_thread(args.func, args))


def replies_by_turn(request: pb.GenerateRequest) -> Script:
    turn = sum(m.role == "user" for m in request.chat.messages)
    return Script(stream([(f"reply {turn}", [100 + turn])], request_id=f"r{turn}"))


async def test_generate_json_prints_one_object(
    fake: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.servicer.script = lambda _: Script(stream(PIECES, prompt_ids=[5, 6], request_id="abc"))
    code = await tandem("generate", "--server", fake.address, "--prompt", "Capital?", "--json")
    out, err = capsys.readouterr()
    assert code == 0 and err == ""
    assert json.loads(out) == {
        "prompt_token_ids": [5, 6],
        "token_ids": [42, 7, 3],
        "text": "Paris is.",
        "finish_reason": "stop",
        "stop_reason": None,  # the model's own end
        "usage": {"prompt_tokens": 2, "completion_tokens": 3},
        "request_id": "abc",
        "trace_id": TRACE_ID,
    }
    assert out.count("\n") == 1
    (request,) = fake.servicer.requests
    assert request.text == "Capital?" and request.sampling.temperature == 0.0
    assert not request.HasField("max_tokens")  # the server picks, within the context


async def test_generate_json_names_the_stop_string_that_ended_it(
    fake: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    def stopped(_: pb.GenerateRequest) -> Script:
        messages = stream(PIECES)
        messages[-1].stop_string = " is"
        return Script(messages)

    fake.servicer.script = stopped
    code = await tandem(
        "generate", "--server", fake.address, "--prompt", "Capital?", "--stop", " is", "--json"
    )
    out, _ = capsys.readouterr()
    assert code == 0 and json.loads(out)["stop_reason"] == " is"
    (request,) = fake.servicer.requests
    assert list(request.stop) == [" is"]


async def test_generate_prints_the_prompts_scores(
    fake: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    def scored(_: pb.GenerateRequest) -> Script:
        replies = stream(PIECES, prompt_ids=[5, 6])
        top = [pb.TokenLogprob(token_id=9, logprob=-0.5)]
        replies[1].prompt_logprobs.add(token_id=6, logprob=-2.0, rank=3, top_logprobs=top)
        return Script(replies)

    fake.servicer.script = scored
    argv = ["--server", fake.address, "--prompt", "Capital?", "--json", "--prompt-logprobs", "1"]
    assert await tandem("generate", *argv) == 0
    out, _ = capsys.readouterr()
    assert json.loads(out)["prompt_logprobs"] == [
        {"token_id": 6, "logprob": -2.0, "rank": 3, "top": [[9, -0.5]]}
    ]
    assert fake.servicer.requests[0].prompt_logprobs == 1
    # Scores are JSON: without --json the flag is refused before anything is sent.
    code = await tandem(
        "generate", "--server", fake.address, "--prompt", "x", "--prompt-logprobs", "0"
    )
    assert code == 2 and "--prompt-logprobs is printed with --json" in capsys.readouterr().err
    assert len(fake.servicer.requests) == 1


async def test_generate_streams_text(fake: FakeServer, capsys: pytest.CaptureFixture[str]) -> None:
    fake.servicer.script = lambda _: Script(stream(PIECES, request_id="abc"))
    code = await tandem("generate", "--server", fake.address, "--prompt-ids", "1,2,3")
    out, err = capsys.readouterr()
    assert code == 0 and out == "Paris is."
    assert "3 generated tokens, finish: stop, request abc" in err
    assert list(fake.servicer.requests[0].token_ids.ids) == [1, 2, 3]


async def test_generate_sends_the_flags(
    fake: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--server", fake.address, "--chat", "--system", "Be brief.", "--prompt", "Hi"]
    argv += ["--max-tokens", "9", "--ignore-eos", "--temperature", "0.7", "--top-p", "0.5"]
    argv += ["--top-k", "20", "--seed", "3", "--priority", "2", "--session-id", "s1"]
    assert await tandem("generate", *argv, "--json") == 0
    (request,) = fake.servicer.requests
    assert [(m.role, m.content) for m in request.chat.messages] == [
        ("system", "Be brief."),
        ("user", "Hi"),
    ]
    assert (request.max_tokens, request.ignore_eos, request.priority) == (9, True, 2)
    assert request.session_id == "s1"
    s = request.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed) == (pytest.approx(0.7), 0.5, 20, 3)


async def test_generate_error_is_one_line(
    fake: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    message = "max_tokens: 2040 prompt tokens + 16 exceed the model's context of 2048"
    fake.servicer.script = lambda _: Script([], abort=(grpc.StatusCode.INVALID_ARGUMENT, message))
    code = await tandem("generate", "--server", fake.address, "--prompt", "x", "--json")
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err == f"tandem generate: error: INVALID_ARGUMENT: {message}\n"


async def test_generate_deadline(fake: FakeServer, capsys: pytest.CaptureFixture[str]) -> None:
    fake.servicer.script = lambda _: Script([], hang=True)
    code = await tandem("generate", "--server", fake.address, "--prompt", "x", "--timeout", "0.3")
    assert code == 2
    assert capsys.readouterr().err.startswith("tandem generate: error: DEADLINE_EXCEEDED: ")


async def test_generate_unreachable_says_how_to_start_a_server(
    closed_address: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = await tandem("generate", "--server", closed_address, "--prompt", "x")
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.startswith(
        f"tandem generate: error: UNAVAILABLE: the server is not reachable at {closed_address}; "
        "start one with `tandem serve`"
    )
    assert "Traceback" not in err and err.count("\n") == 1


class _QuietHandler(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


async def test_generate_at_an_http_port_says_it_is_not_grpc(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The commonest slip: --server given the OpenAI-compatible HTTP port."""
    http = ThreadingHTTPServer(("127.0.0.1", 0), _QuietHandler)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{http.server_address[1]}"
    try:
        code = await tandem("generate", "--server", address, "--prompt", "x")
    finally:
        http.shutdown()
        http.server_close()
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err == (
        f"tandem generate: error: UNAVAILABLE: {address} answers, but not in gRPC (tandem's "
        "OpenAI-compatible HTTP port?); --server takes tandem's gRPC address (`tandem serve "
        "--port`, 127.0.0.1:50051 by default)\n"
    )


async def test_unavailable_from_a_live_server_is_its_own_message(
    fake: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    message = "the scheduler is (re)starting; try again shortly"
    fake.servicer.script = lambda _: Script([], abort=(grpc.StatusCode.UNAVAILABLE, message))
    assert await tandem("generate", "--server", fake.address, "--prompt", "x") == 2
    assert capsys.readouterr().err == f"tandem generate: error: UNAVAILABLE: {message}\n"


async def test_chat_keeps_history_and_one_session(
    fake: FakeServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.servicer.script = replies_by_turn
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\n\nHow are you?\n/exit\nnever sent\n"))
    code = await tandem("chat", "--server", fake.address, "--system", "Be kind.")
    out, _ = capsys.readouterr()
    assert code == 0 and out == "reply 1\nreply 2\n"
    first, second = fake.servicer.requests
    assert [(m.role, m.content) for m in second.chat.messages] == [
        ("system", "Be kind."),
        ("user", "Hello"),
        ("assistant", "reply 1"),
        ("user", "How are you?"),
    ]
    assert first.session_id and first.session_id == second.session_id


async def test_chat_reset_starts_a_new_conversation(
    fake: FakeServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.servicer.script = replies_by_turn
    monkeypatch.setattr(sys, "stdin", io.StringIO("One\n/reset\nTwo\n"))  # then end of input
    assert await tandem("chat", "--server", fake.address) == 0
    first, second = fake.servicer.requests
    assert [m.content for m in second.chat.messages] == ["Two"]
    assert first.session_id != second.session_id


class InterruptOnce(io.StringIO):
    """stdout that raises KeyboardInterrupt once, when `trigger` is written: Ctrl-C mid-reply."""

    def __init__(self, trigger: str) -> None:
        super().__init__()
        self.trigger: str | None = trigger

    def write(self, text: str) -> int:
        if self.trigger is not None and self.trigger in text:
            self.trigger = None
            raise KeyboardInterrupt
        return super().write(text)


async def test_ctrl_c_cancels_only_that_reply(
    fake: FakeServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def script(request: pb.GenerateRequest) -> Script:
        if request.chat.messages[-1].content == "long":
            return Script(stream([("slow", [1])], finish_reason=""), hang=True)
        return replies_by_turn(request)

    fake.servicer.script = script
    stdout = InterruptOnce("slow")
    monkeypatch.setattr(sys, "stdout", stdout)
    monkeypatch.setattr(sys, "stdin", io.StringIO("long\nshort\n"))
    assert await tandem("chat", "--server", fake.address) == 0
    await asyncio.wait_for(fake.servicer.cancelled.wait(), WAIT)
    assert "[reply cancelled]" in capsys.readouterr().err
    assert stdout.getvalue() == "\nreply 1\n"  # the cancelled turn is not in the history either
    assert [m.content for m in fake.servicer.requests[1].chat.messages] == ["short"]


async def test_chat_unreachable_exits(
    closed_address: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\nAgain\n"))
    assert await tandem("chat", "--server", closed_address) == 2
    err = capsys.readouterr().err
    assert err.count("not reachable") == 1


async def test_generate_error_mid_stream_ends_the_line_first(
    fake: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.servicer.script = lambda _: Script(
        stream(PIECES[:1], finish_reason=""), abort=(grpc.StatusCode.UNAVAILABLE, "worker died")
    )
    assert await tandem("generate", "--server", fake.address, "--prompt", "x") == 2
    out, err = capsys.readouterr()
    assert out == "Paris\n"
    assert err == "tandem generate: error: UNAVAILABLE: worker died\n"


@pytest.mark.parametrize(
    ("flags", "kind", "value"),
    [
        (["--json-object"], "json_object", True),
        (["--regex", "[0-9]+"], "regex", "[0-9]+"),
        (["--choice", "yes", "--choice", "no"], "choice", ["yes", "no"]),
    ],
)
async def test_generate_sends_an_output_format(
    fake: FakeServer, flags: list[str], kind: str, value: object
) -> None:
    fake.servicer.script = lambda _: Script(stream(PIECES))
    assert await tandem("generate", "--server", fake.address, "--prompt", "Hi", *flags) == 0
    (request,) = fake.servicer.requests
    assert request.output_format.WhichOneof("format") == kind
    got = getattr(request.output_format, kind)
    assert (list(got.choices) if kind == "choice" else got) == value


@pytest.mark.parametrize(
    ("flag", "text"), [("--json-schema", '{"type": "integer"}'), ("--grammar", 'root ::= "a"')]
)
async def test_generate_reads_a_json_schema_or_grammar_file(
    fake: FakeServer, tmp_path: pytest.TempPathFactory, flag: str, text: str
) -> None:
    fake.servicer.script = lambda _: Script(stream(PIECES))
    path = tmp_path / "form"  # type: ignore[operator]
    path.write_text(text)
    assert (
        await tandem("generate", "--server", fake.address, "--prompt", "Hi", flag, str(path)) == 0
    )
    assert getattr(fake.servicer.requests[0].output_format, flag[2:].replace("-", "_")) == text
    missing = str(path) + ".missing"
    with pytest.raises(InvalidOption, match=f"{flag}: cannot read {missing}: No such file"):
        await tandem("generate", "--server", fake.address, "--prompt", "Hi", flag, missing)
