"""`tandem generate` (one generation from a running server) and `tandem chat` (a conversation)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from typing import TYPE_CHECKING, Any, cast

from services.cli_args import (
    add_format_args,
    add_prompt_args,
    add_sampling_args,
    chat_messages,
    format_from_args,
    sampling_from_args,
)

if TYPE_CHECKING:
    from services.client_sync import Client
    from services.client_types import (
        Connection,
        GenerateOptions,
        GenerationResult,
        Message,
        TandemError,
    )

DEFAULT_SERVER = "127.0.0.1:50051"
EXIT_COMMANDS = ("/exit", "/quit")


def register(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser(
        "generate",
        help="stream one generation from a running server",
        description="Send one prompt to a tandem server and stream the reply to the terminal.",
    )
    _add_server_args(gen)
    add_prompt_args(gen)
    add_sampling_args(gen, max_tokens=None)
    add_format_args(gen)
    gen.add_argument(
        "--prompt-logprobs",
        type=int,
        metavar="N",
        help="score the prompt too: each of its tokens' logprob, rank and top N (with --json)",
    )
    gen.set_defaults(func=_generate, user_errors=_user_errors())

    chat = sub.add_parser(
        "chat",
        help="talk to a running server, turn by turn",
        description="A multi-turn chat on stdin/stdout: /exit or end of input quits, /reset starts "
        "over, Ctrl-C during a reply cancels that reply.",
    )
    _add_server_args(chat)
    chat.add_argument("--system", help="a system message that opens the conversation")
    add_sampling_args(chat, max_tokens=None, json_flag=False)
    chat.set_defaults(func=_chat, user_errors=_user_errors())


def _output_format(args: argparse.Namespace) -> dict[str, Any] | None:
    """The format flags as the request's OutputFormat (a dict of it)."""
    form = format_from_args(args)
    if form is None:
        return None
    kind, value = form
    return {"choice": {"choices": value}} if kind == "choice" else {kind: value}


def _user_errors() -> tuple[type[Exception], ...]:
    from services.client_types import InvalidOption

    return (InvalidOption,)


def _add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--server",
        default=DEFAULT_SERVER,
        help=f"HOST:PORT of the server (default {DEFAULT_SERVER})",
    )
    parser.add_argument("--priority", type=int, default=0, help="higher runs first (default 0)")
    parser.add_argument("--session-id", help="keeps a conversation's KV cached between turns")
    parser.add_argument("--timeout", type=float, help="seconds before the request is abandoned")
    # --api-key and TLS: what a client needs to reach a server started with them.
    parser.add_argument(
        "--api-key",
        default=os.environ.get("TANDEM_API_KEY", "").split(",")[0] or None,
        help="sent as `authorization: Bearer KEY` (default: $TANDEM_API_KEY, its first key)",
    )
    parser.add_argument("--tls", action="store_true", help="connect with TLS (system CAs)")
    parser.add_argument("--ssl-ca-certs", help="TLS, trusting this CA file (PEM)")
    parser.add_argument("--ssl-certfile", help="a client certificate, where the server asks")
    parser.add_argument("--ssl-keyfile", help="its key")


def connection_of(args: argparse.Namespace) -> Connection:
    from services.client_types import Connection

    return Connection(
        api_key=args.api_key or None,
        tls=args.tls,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
    )


def _options(args: argparse.Namespace) -> GenerateOptions:
    # Sampling values are checked by the server, which names a bad one (INVALID_ARGUMENT).
    options = {
        **sampling_from_args(args),
        "max_tokens": args.max_tokens,
        "stop": args.stop,
        "ignore_eos": args.ignore_eos,
        "priority": args.priority,
        "session_id": args.session_id or "",
        "timeout": args.timeout,
    }
    return cast("GenerateOptions", options)


def _generate(args: argparse.Namespace) -> int:
    from services.client_sync import Client
    from services.client_types import TandemError

    options = _options(args)
    if args.prompt_logprobs is not None:
        if not args.json:
            print("tandem generate: --prompt-logprobs is printed with --json", file=sys.stderr)
            return 2
        options["prompt_logprobs"] = args.prompt_logprobs
    if (output_format := _output_format(args)) is not None:
        options["output_format"] = output_format
    prompt = None if args.chat else args.prompt
    if args.chat:
        options["messages"] = chat_messages(args)
    elif prompt is None:
        options["prompt_ids"] = args.prompt_ids
    with (
        Client(args.server, connection=connection_of(args)) as client,
        client.generate(prompt, **options) as generation,
    ):
        try:
            for delta in generation:
                if not args.json:
                    print(delta.text, end="", flush=True)
        except TandemError as err:
            if generation.result.text and not args.json:
                print()  # end the partial text's line before the error
            _report(args.command, err, client)
            return 2
    result = generation.result
    if args.json:
        print(json.dumps(_as_json(result, with_logprobs=args.logprobs > 0), ensure_ascii=False))
    else:
        trace = f", trace {result.trace_id}" if result.trace_id else ""
        print(
            f"\n[{len(result.prompt_token_ids)} prompt + {len(result.token_ids)} generated tokens, "
            f"finish: {result.finish_reason}, request {result.request_id}{trace}]",
            file=sys.stderr,
        )
    return 0


def _as_json(result: GenerationResult, with_logprobs: bool) -> dict[str, Any]:
    usage = result.usage
    out: dict[str, Any] = {
        "prompt_token_ids": result.prompt_token_ids,
        "token_ids": result.token_ids,
        "text": result.text,
        "finish_reason": result.finish_reason,
        "stop_reason": result.stop_reason,  # the request's stop string or stop token id, if one
        "usage": {
            "prompt_tokens": usage.prompt_tokens if usage else len(result.prompt_token_ids),
            "completion_tokens": usage.completion_tokens if usage else len(result.token_ids),
        },
        "request_id": result.request_id,
        "trace_id": result.trace_id,
    }
    if result.prompt_logprobs:
        out["prompt_logprobs"] = [
            {
                "token_id": t.token_id,
                "logprob": t.logprob,
                "rank": t.rank,
                "top": [list(p) for p in t.top],
            }
            for t in result.prompt_logprobs
        ]
    if with_logprobs:
        out["logprobs"] = [
            {"token_id": t.token_id, "logprob": t.logprob, "top": [list(p) for p in t.top]}
            for t in result.logprobs
        ]
    return out


def _report(command: str, err: TandemError, client: Client) -> bool:
    """Print the error; True when the server cannot be reached at all."""
    import grpc

    from services.client_base import answers_not_in_grpc

    message = err.message
    # UNAVAILABLE is also what a live server says while its scheduler restarts: only blame the
    # address when the channel really cannot connect.
    unreachable = err.code == grpc.StatusCode.UNAVAILABLE and not client.connected()
    if unreachable and answers_not_in_grpc(err):
        message = (
            f"{client.address} answers, but not in gRPC (tandem's OpenAI-compatible HTTP port?); "
            f"--server takes tandem's gRPC address (`tandem serve --port`, {DEFAULT_SERVER} "
            "by default)"
        )
    elif unreachable:
        message = (
            f"the server is not reachable at {client.address}; start one with `tandem serve` "
            f"or point --server at it ({err.message})"
        )
    print(f"tandem {command}: error: {err.code.name}: {message}", file=sys.stderr)
    return unreachable


def _chat(args: argparse.Namespace) -> int:
    from services.client_sync import Client
    from services.client_types import TandemError

    options = _options(args)
    options["session_id"] = args.session_id or uuid.uuid4().hex
    opening: list[Message] = [{"role": "system", "content": args.system}] if args.system else []
    history = list(opening)
    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401  (line editing and history for input())
    with Client(args.server, connection=connection_of(args)) as client:
        while True:
            try:
                line = input(">>> " if interactive else "")
            except (EOFError, KeyboardInterrupt):
                break
            text = line.strip()
            if not text:
                continue
            if text in EXIT_COMMANDS:
                break
            if text == "/reset":
                history = list(opening)
                options["session_id"] = uuid.uuid4().hex
                continue
            messages = [*history, {"role": "user", "content": text}]
            try:
                reply = _reply(client, messages, options)
            except KeyboardInterrupt:
                # The turn is dropped from the history: the model never finished it.
                print(flush=True)
                print("[reply cancelled]", file=sys.stderr)
                continue
            except TandemError as err:
                if _report(args.command, err, client):
                    return 2
                continue
            history = [*messages, {"role": "assistant", "content": reply}]
    if interactive:
        print()
    return 0


def _reply(client: Client, messages: list[Message], options: GenerateOptions) -> str:
    turn: GenerateOptions = {**options, "messages": messages}
    with client.generate(**turn) as generation:
        for delta in generation:
            print(delta.text, end="", flush=True)
    print(flush=True)
    return generation.result.text
