"""Tokenize and Detokenize as both doors run them: the gRPC API's messages in (the HTTP door
converts its bodies to them, as it does for Generate), ids or text out."""

from __future__ import annotations

from functools import partial

from services.tokenizer.admission import Admission, off_the_loop_if_long
from services.tokenizer.request import (
    MAX_CHARS_PER_TOKEN,
    chat_messages,
    chat_rendering,
    chat_tools,
    check_model,
)
from tandem.v1 import generation_pb2 as pb


async def tokenize(admission: Admission, request: pb.TokenizeRequest) -> list[int]:
    """The ids a Generate request with this prompt would run: a chat through the template."""
    check_model(request.model, admission.model_name)
    messages = tools = rendering = None
    if request.WhichOneof("input") == "chat":
        max_chars = admission.max_seq_len * MAX_CHARS_PER_TOKEN
        messages = chat_messages(request.chat, max_chars)
        tools = chat_tools(request.chat, max_chars)
        rendering = chat_rendering(request.chat, max_chars)
    allow_special = not request.split_special_tokens
    return await admission.encode(
        request.text, messages, allow_special=allow_special, tools=tools, rendering=rendering
    )


async def detokenize(admission: Admission, request: pb.DetokenizeRequest) -> str:
    check_model(request.model, admission.model_name)
    ids = list(request.token_ids)
    tokenizer = admission.tokenizer
    decode = partial(tokenizer.decode, ids, skip_special=request.skip_special_tokens)
    return await off_the_loop_if_long(len(ids), decode)
