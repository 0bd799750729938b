"""An HTTP answer's streamed choices, as a client reads them, from the texts a plan's one
sequence brings (the last one ending it)."""

from __future__ import annotations

import json
from typing import Any

from engine.tokenizer import Tokenizer
from services.tokenizer.http.convert import Plan
from services.tokenizer.http.output import Output
from tandem.v1 import generation_pb2 as pb


def streamed(plan: Plan, tokenizer: Tokenizer, *texts: str) -> list[dict[str, Any]]:
    output = Output(tokenizer, "id", "m", plan)
    events = []
    for i, text in enumerate(texts):
        finish = "stop" if i == len(texts) - 1 else ""
        events += output.stream(0, pb.GenerateResponse(text=text, finish_reason=finish))
    return [json.loads(e.removeprefix("data: "))["choices"][0] for e in events]
