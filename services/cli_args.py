"""Flags shared by the commands that generate (`run`, `generate`, `chat`), and their parsing."""

from __future__ import annotations

import argparse

from engine.errors import InvalidRequest
from engine.sampling_params import SamplingParams


def add_prompt_args(parser: argparse.ArgumentParser) -> None:
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt text")
    prompt.add_argument(
        "--prompt-ids", type=parse_ids, metavar="ID,ID,...", help="the prompt as token ids"
    )
    parser.add_argument(
        "--chat", action="store_true", help="wrap --prompt as one user message in the chat template"
    )
    parser.add_argument("--system", help="with --chat: a system message before the prompt")


def add_sampling_args(
    parser: argparse.ArgumentParser, *, max_tokens: int | None = 256, json_flag: bool = True
) -> None:
    """`max_tokens=None` leaves the limit to the server; `json_flag=False` omits `--json`."""
    limit = "up to 256, within the context" if max_tokens is None else max_tokens
    parser.add_argument(
        "--max-tokens", type=int, default=max_tokens, help=f"tokens to generate ({limit})"
    )
    parser.add_argument(
        "--ignore-eos", action="store_true", help="keep going past end-of-sequence tokens"
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 (the default) is greedy decoding"
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely (0: off)")
    parser.add_argument("--min-p", type=float, default=0.0, help="drop below min-p × best (0: off)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="1: off")
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="0: off")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="0: off")
    parser.add_argument("--seed", type=int, help="makes sampling reproducible")
    parser.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)"
    )
    parser.add_argument("--logprobs", type=int, default=0, help="top-n logprobs per token (JSON)")
    if json_flag:
        parser.add_argument(
            "--json", action="store_true", help="print one JSON object instead of streaming text"
        )


def parse_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        logprobs=args.logprobs,
    )


def chat_messages(args: argparse.Namespace) -> list[dict[str, str]]:
    if args.prompt is None:
        raise InvalidRequest("chat", "--chat needs --prompt text, not --prompt-ids")
    messages = [{"role": "system", "content": args.system}] if args.system else []
    return [*messages, {"role": "user", "content": args.prompt}]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Where and how the model runs: shared by `tandem run`, `tandem serve` and the worker."""
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="activations and dequantized weights; auto: float32 on CPU, bfloat16 on CUDA",
    )
    parser.add_argument(
        "--quantize",
        default="auto",
        choices=["auto", "int4", "none", "int8"],
        help="auto: the fastest measured choice; on CPU, GGUF Q4_0/Q4_1/Q8_0 weights are served "
        "as they are by tandem's native kernels (int8 activations as llama.cpp's, AVX-512 VNNI; "
        "where those cannot be built, as int4), and float weights are packed; int4 (CPU): the "
        "GGUF's codes through torch's int4 kernel with bf16 activations, beside a oneDNN-packed "
        "bf16 copy for large steps: logits closer to fp32 (KL 0.001-0.002 against 0.005), at "
        "about half the speed; none: plain dequantized weights in --dtype; int8: weight-only "
        "int8 with per-channel scales",
    )


def dtype_for(device: str, dtype: str) -> str:
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.startswith("cuda") else "float32"
