"""A chat reply of given texts answered as another API's (the Responses or the Messages API's):
its streamed events and its whole answer, for tests."""

from __future__ import annotations

from typing import Any

from engine.tokenizer import Tokenizer
from services.tokenizer.http.chat_apis import Answer
from services.tokenizer.http.convert import Plan
from services.tokenizer.http.output import Output
from tandem.v1 import generation_pb2 as pb


def answered(
    tokenizer: Tokenizer,
    plan: Plan,
    streamed: Answer,
    whole: Answer,
    texts: list[str],
    cached: int = 0,
    stop_string: str = "",
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The events `streamed` makes of the chat chunks of a reply of these texts (the last one
    ending it, by `stop_string` where given), and what `whole` makes of the whole completion;
    the prompt is 3 tokens, `cached` of them found in the prefix cache."""
    whole_out, stream_out = Output(tokenizer, "id", "m", plan), Output(tokenizer, "id", "m", plan)
    prompt = pb.GenerateResponse(prompt_token_ids=[1, 2, 3])
    whole_out.on_prompts([prompt])
    stream_out.on_prompts([prompt])
    events = streamed.begin()
    made = 0
    for i, text in enumerate(texts):
        last = i == len(texts) - 1
        msg = pb.GenerateResponse(text=text, finish_reason="stop" if last else "")
        msg.token_ids.extend(tokenizer.encode(text, allow_special=False))
        made += len(msg.token_ids)
        if last:
            msg.usage.completion_tokens = made
            msg.usage.cached_prompt_tokens = cached
            if stop_string:
                msg.stop_string = stop_string
        whole_out.add(0, msg)
        for chunk in stream_out.chunks(0, msg):
            events += streamed.events(chunk)
    for chunk in stream_out.last_chunks():
        events += streamed.events(chunk)
    events += streamed.end()
    return events, whole.whole(whole_out.whole())
