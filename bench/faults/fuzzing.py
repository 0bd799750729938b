"""Fuzzed requests for every public RPC, as the bytes that go on the wire.

Most are well-formed messages whose fields take random and extreme values (huge and empty
strings, control and special-token text, out-of-range ids, NaN and infinite sampling values,
int32 extremes, duplicate request ids, any n, min_tokens and logit_bias); the rest are broken at
the wire level: strings that are not UTF-8, truncated or bit-flipped messages, random bytes.
"""

from __future__ import annotations

import math
import random
import struct
from collections.abc import Callable

from grpc_health.v1 import health_pb2

from tandem.v1 import generation_pb2 as pb

WIRE_SHARE = 0.15
I32 = (0, 1, -1, 2, 7, 255, 2**31 - 1, -(2**31), 49151, 49152, 128256, 8192, 8191, 100_000)
FLOATS = (
    0.0,
    -0.0,
    1.0,
    0.5,
    2.0,
    -1.0,
    1e-45,
    1e-7,
    3.4e38,
    -3.4e38,
    math.inf,
    -math.inf,
    math.nan,
)
SPECIAL = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<s>", "</s>", "{{", "{%")
ROLES = ("system", "user", "assistant", "tool", "", "admin", "USER", "user\x00")
REQUEST_IDS = tuple(f"dup-{i}" for i in range(4))  # shared by concurrent requests on purpose


def text(rng: random.Random) -> str:
    kind = rng.randrange(12)
    if kind == 0:
        return ""
    if kind == 1:
        return "".join(chr(rng.randrange(0x20, 0x7F)) for _ in range(rng.randrange(1, 64)))
    if kind == 2:  # any code point but surrogates (protobuf refuses to encode those)
        points = (
            rng.choice((rng.randrange(0xD800), rng.randrange(0xE000, 0x110000)))
            for _ in range(rng.randrange(1, 64))
        )
        return "".join(map(chr, points))
    if kind == 3:
        return "".join(rng.choice(SPECIAL) for _ in range(rng.randrange(1, 20)))
    if kind == 4:
        return "\x00" * rng.randrange(1, 100)
    if kind == 5:
        return rng.choice(
            ("\u202e", "\u0301", "\ufeff", "\U0001f600", "\r\n", "\t")
        ) * rng.randrange(1, 500)
    if kind == 6 and rng.random() < 0.2:  # huge: past the prompt limit, or just under it
        return rng.choice("ab ") * rng.choice((100_000, 600_000, 2_000_000))
    if kind == 7:
        return " " * rng.randrange(1, 3000)
    return " ".join(
        rng.choice(("hello", "world", "tandem", "\u00e9t\u00e9", "\u4f60\u597d"))
        for _ in range(rng.randrange(1, 200))
    )


def i32(rng: random.Random) -> int:
    return rng.choice(I32) if rng.random() < 0.7 else rng.randint(-(2**31), 2**31 - 1)


def f32(rng: random.Random) -> float:
    return rng.choice(FLOATS) if rng.random() < 0.7 else rng.uniform(-100, 100)


def ids(rng: random.Random) -> list[int]:
    n = rng.choice((0, 1, 3, 50, 1000, 9000, 20000))
    if rng.random() < 0.5:
        return [rng.randrange(0, 49152) for _ in range(n)]
    return [i32(rng) for _ in range(n)]


def chat(rng: random.Random, messages: pb.ChatMessages) -> None:
    for _ in range(rng.choice((0, 1, 2, 3, 50, 500))):
        messages.messages.add(role=rng.choice(ROLES), content=text(rng))


def sampling(rng: random.Random, params: pb.SamplingParams) -> None:
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ):
        if rng.random() < 0.5:
            setattr(params, name, f32(rng))
    if rng.random() < 0.5:
        params.top_k = i32(rng)
    if rng.random() < 0.3:
        params.seed = rng.choice((0, 1, 2**64 - 1, rng.getrandbits(64)))
    if rng.random() < 0.2:
        for _ in range(rng.choice((1, 3, 300))):
            params.logit_bias[i32(rng)] = f32(rng)


def generate(rng: random.Random) -> pb.GenerateRequest:
    r = pb.GenerateRequest()
    which = rng.randrange(4)
    if which == 0:
        r.text = text(rng)
    elif which == 1:
        chat(rng, r.chat)
    elif which == 2:
        r.token_ids.ids.extend(ids(rng))
    if rng.random() < 0.7:
        sampling(rng, r.sampling)
    if rng.random() < 0.7:
        r.max_tokens = rng.choice((1, 2, 4, 16)) if rng.random() < 0.5 else i32(rng)
    for _ in range(rng.choice((0, 0, 1, 3, 17))):
        r.stop.append(text(rng)[:300])
    r.stop_token_ids.extend(i32(rng) for _ in range(rng.choice((0, 0, 1, 5))))
    r.ignore_eos = rng.random() < 0.5
    if rng.random() < 0.3:
        r.priority = i32(rng)
    if rng.random() < 0.2:
        r.session_id = text(rng)[:200]
    if rng.random() < 0.3:
        r.logprobs = rng.choice((0, 1, 20, 21, -1, 2**31 - 1))
    if rng.random() < 0.1:
        r.model = rng.choice(("smollm2-135m-instruct", "nope", text(rng)[:50]))
    if rng.random() < 0.3:
        r.request_id = rng.choice(REQUEST_IDS) if rng.random() < 0.5 else text(rng)[:200]
    r.split_special_tokens = rng.random() < 0.5
    if rng.random() < 0.2:
        r.n = rng.choice((0, 1, 2, 17, -1, 2**31 - 1))
    if rng.random() < 0.2:
        r.min_tokens = i32(rng)
    return r


def tokenize(rng: random.Random) -> pb.TokenizeRequest:
    r = pb.TokenizeRequest(split_special_tokens=rng.random() < 0.5)
    if rng.random() < 0.5:
        r.text = text(rng)
    else:
        chat(rng, r.chat)
    if rng.random() < 0.1:
        r.model = text(rng)[:50]
    return r


def detokenize(rng: random.Random) -> pb.DetokenizeRequest:
    r = pb.DetokenizeRequest(token_ids=ids(rng), skip_special_tokens=rng.random() < 0.5)
    if rng.random() < 0.1:
        r.model = text(rng)[:50]
    return r


def list_models(rng: random.Random) -> pb.ListModelsRequest:
    return pb.ListModelsRequest()


def health(rng: random.Random) -> health_pb2.HealthCheckRequest:
    service = rng.choice(("", "tandem.v1.Generation", "nope", text(rng)[:100]))
    return health_pb2.HealthCheckRequest(service=service)


MAKERS: dict[str, Callable[[random.Random], object]] = {
    "Generate": generate,
    "Tokenize": tokenize,
    "Detokenize": detokenize,
    "ListModels": list_models,
    "Health.Check": health,
}


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def not_utf8(rng: random.Random) -> bytes:
    lead = rng.choice((0xFF, 0xFE, 0xC0, 0x80, 0xED))  # never valid where it stands
    return bytes([lead]) + rng.randbytes(rng.randrange(0, 16))


def _bad_string_field(rng: random.Random, rpc: str) -> bytes:
    """A message whose string field (top-level or in a chat message) is not UTF-8."""
    bad = not_utf8(rng)
    if rpc in ("Generate", "Tokenize") and rng.random() < 0.5:
        role = _field(1, b"user") if rng.random() < 0.5 else _field(1, bad)
        message = role + _field(2, bad)
        return _field(2, _field(1, message))  # chat.messages[0]
    numbers = {
        "Generate": (1, 6, 10, 12, 13),  # text, stop, session_id, model, request_id
        "Tokenize": (1, 3),
        "Detokenize": (3,),
        "ListModels": (1,),  # an unknown field: skipped by the parser whatever it holds
        "Health.Check": (1,),
    }[rpc]
    return _field(rng.choice(numbers), bad)


def wire(rng: random.Random, rpc: str, good: bytes) -> bytes:
    kind = rng.randrange(5)
    if kind == 0:
        return _bad_string_field(rng, rpc)
    if kind == 1 and good:
        return good[: rng.randrange(len(good))]
    if kind == 2 and good:
        flipped = bytearray(good)
        for _ in range(rng.randint(1, 8)):
            flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        return bytes(flipped)
    if kind == 3:
        return bytes(rng.randrange(256) for _ in range(rng.choice((1, 7, 64, 1000))))
    return good + struct.pack("<I", rng.getrandbits(32)) + _field(rng.randrange(1, 2000), b"x")


def payload(rng: random.Random, rpc: str) -> tuple[bytes, str]:
    """The bytes of one fuzzed request, and whether they were broken at the wire level."""
    message = MAKERS[rpc](rng)
    good = message.SerializeToString()  # type: ignore[attr-defined]
    if rng.random() < WIRE_SHARE:
        return wire(rng, rpc, good), "wire"
    return good, "message"
