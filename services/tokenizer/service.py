"""The public `tandem.v1.Generation` servicer: thin — parse, hand to the admission path."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from grpc import aio

from services.errors import Unavailable
from services.tokenizer.admission import Admission
from services.tokenizer.tokenizing import detokenize, tokenize
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, admission: Admission) -> None:
        self.admission = admission

    async def Generate(
        self, request: pb.GenerateRequest, context: aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        a = self.admission
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        with a.telemetry.begin(context.invocation_metadata()) as call:
            spec = a.parse(request)
            # Closed explicitly, so a client that goes away cancels the work at once.
            async with contextlib.aclosing(a.generate(spec, call, deadline)) as replies:
                async for reply in replies:
                    yield reply

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: aio.ServicerContext
    ) -> pb.TokenizeResponse:
        return pb.TokenizeResponse(token_ids=await tokenize(self.admission, request))

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        return pb.DetokenizeResponse(text=await detokenize(self.admission, request))

    async def ListModels(
        self, request: pb.ListModelsRequest, context: aio.ServicerContext
    ) -> pb.ListModelsResponse:
        model = self.admission.link.model
        if model is None:
            raise Unavailable("the scheduler is (re)starting")
        return pb.ListModelsResponse(
            models=[
                pb.ModelInfo(
                    name=self.admission.model_name,
                    context_length=model.max_seq_len,
                    vocab_size=model.vocab_size,
                    weight_format=model.weight_format,
                    device=model.device,
                    dtype=model.dtype,
                )
            ]
        )
