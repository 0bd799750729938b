"""The public `tandem.v1.Generation` servicer: thin — parse, hand to the admission path."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from grpc import aio

from engine.errors import InvalidRequest
from services.errors import Unavailable
from services.tokenizer.admission import Admission, off_the_loop_if_long
from services.tokenizer.request import parse_generate
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.tokenizer = admission.tokenizer
        self.model_name = admission.model_name

    async def Generate(
        self, request: pb.GenerateRequest, context: aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        a = self.admission
        call = a.telemetry.begin(context.invocation_metadata())
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        try:
            a.check_ready()
            spec = parse_generate(
                request, self.model_name, self.tokenizer.vocab_size, a.max_seq_len
            )
            # Closed explicitly, so a client that goes away cancels the work at once.
            async with contextlib.aclosing(a.generate(spec, call, deadline)) as replies:
                async for reply in replies:
                    yield reply
        except BaseException as err:
            call.fail(err)
            raise
        finally:
            call.end()

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: aio.ServicerContext
    ) -> pb.TokenizeResponse:
        self._check_model(request.model)
        messages = None
        if request.WhichOneof("input") == "chat":
            messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        allow_special = not request.split_special_tokens
        ids = await self.admission.encode(request.text, messages, allow_special=allow_special)
        return pb.TokenizeResponse(token_ids=ids)

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        self._check_model(request.model)
        ids = list(request.token_ids)

        def decode() -> str:
            return self.tokenizer.decode(ids, skip_special=request.skip_special_tokens)

        return pb.DetokenizeResponse(text=await off_the_loop_if_long(len(ids), decode))

    async def ListModels(
        self, request: pb.ListModelsRequest, context: aio.ServicerContext
    ) -> pb.ListModelsResponse:
        model = self.admission.link.model
        if model is None:
            raise Unavailable("the scheduler is (re)starting")
        return pb.ListModelsResponse(
            models=[
                pb.ModelInfo(
                    name=self.model_name,
                    context_length=model.max_seq_len,
                    vocab_size=model.vocab_size,
                    weight_format=model.weight_format,
                    device=model.device,
                    dtype=model.dtype,
                )
            ]
        )

    def _check_model(self, name: str) -> None:
        if name and name != self.model_name:
            raise InvalidRequest(
                "model", f"unknown model {name!r}; this server serves {self.model_name!r}"
            )
