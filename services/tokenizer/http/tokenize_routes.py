"""POST /tokenize and /detokenize, as vLLM serves them: a prompt's ids, or a chat's through the
template (the ids a completion or chat completion of it runs), with their count and the model's
context; and ids back to text. They run the gRPC API's Tokenize and Detokenize."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter
from fastapi.params import Depends

from services.errors import Unavailable
from services.tokenizer.admission import Admission
from services.tokenizer.http.convert import detokenize_request, tokenize_request
from services.tokenizer.http.schemas import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from services.tokenizer.http.tool_formats import ToolFormat
from services.tokenizer.tokenizing import detokenize, tokenize


def tokenize_routes(
    a: Admission,
    dependencies: Sequence[Depends],
    responses: dict[int | str, dict[str, Any]],
    tool_form: ToolFormat,
) -> APIRouter:
    router = APIRouter(dependencies=dependencies, responses=responses)

    @router.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize_prompt(body: TokenizeRequest) -> dict[str, Any]:
        model = a.link.model
        if model is None:
            raise Unavailable("the scheduler is (re)starting")
        ids = await tokenize(a, tokenize_request(body, a.model_name, tool_form))
        texts = None
        if body.return_token_strs:
            texts = [a.tokenizer.token_bytes(i).decode("utf-8", errors="replace") for i in ids]
        return {
            "count": len(ids),
            "max_model_len": model.max_seq_len,
            "tokens": ids,
            "token_strs": texts,
        }

    @router.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize_ids(body: DetokenizeRequest) -> dict[str, str]:
        request = detokenize_request(body, a.model_name, a.tokenizer.vocab_size)
        return {"prompt": await detokenize(a, request)}

    return router
