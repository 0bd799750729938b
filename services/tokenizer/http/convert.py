"""OpenAI request bodies → `tandem.v1.GenerateRequest`s, the message the gRPC API takes, so both
doors go through the same `parse_generate` and admission. What tandem does not support is
refused here, naming the field; unknown fields were refused by the schema already."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequest
from services.errors import NotFound
from services.tokenizer.http.output_format import add_output_format, format_param
from services.tokenizer.http.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ContentPart,
    DetokenizeRequest,
    TokenizeRequest,
    _Rendering,
    _Sampling,
)
from services.tokenizer.http.tool_calls import Calls, tool_calls, tools_json
from services.tokenizer.http.tool_formats import LLAMA_JSON, ToolFormat
from tandem.v1 import generation_pb2 as pb

_FLOAT32_MAX = 3.4028234663852886e38
MAX_PROMPTS = 64  # prompts of one completions request
_ROLES = {"developer": "system"}  # OpenAI's newer name for the system role


@dataclass(frozen=True)
class Plan:
    """What one HTTP request asks for: a GenerateRequest per prompt, and how to answer."""

    requests: list[pb.GenerateRequest]
    n: int  # sequences per prompt: choice index = prompt * n + sequence
    stream: bool
    include_usage: bool
    continuous_usage: bool  # the usage so far in every chunk (vLLM's continuous_usage_stats)
    top_logprobs: int | None  # alternatives per token to return; None: no logprobs
    chat: bool  # answered as chat completions, or else as (text) completions
    calls: Calls | None = None  # the output is tool calls, held to their schema
    # The parameter an error in the output format names, where it did not come from
    # response_format (a tool's parameters, structured_outputs.json).
    format_param: str | None = None
    # Completions' echo: each choice's text, and its logprobs, begin with its prompt's.
    echo: bool = False
    generates: bool = True  # False: max_tokens 0 (with echo): the prompt alone is answered
    prompt_logprobs: int | None = None  # vLLM's: the prompt's scores, with these alternatives
    chat_echo: str = ""  # chat's echo: the last (assistant) message, first in the reply
    reasoning: bool = False  # chat: the reply's reasoning apart from its content (reasoning.py)
    token_ids_as_text: bool = False  # logprobs name each token "token_id:<id>" (vLLM's)


def chat_plan(
    body: ChatCompletionRequest,
    request_id: str,
    model_name: str,
    tool_form: ToolFormat = LLAMA_JSON,
    reasons: bool = False,
) -> Plan:
    """reasons: the model reasons in <think> first (reasoning.py): its replies are split,
    unless held to a form (tools, structured outputs), whose grammar has no place for it."""
    _refuse_unsupported_chat(body)
    request = _common(body, request_id, model_name)
    _add_messages(request.chat, body.messages, tool_form)
    _add_rendering(request.chat, body)
    max_tokens = body.max_completion_tokens or body.max_tokens  # both at least 1
    if max_tokens is not None:
        request.max_tokens = max_tokens
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequest("top_logprobs", "needs logprobs: true")
    plan = _plan(body, [request], (body.top_logprobs or 0) if body.logprobs else None)
    plan = _score_prompts(plan, body.prompt_logprobs)
    calls, param = tool_calls(body, request, tool_form)
    echoed = ""
    if body.echo:  # vLLM's: a reply the client began (continue_final_message) comes whole
        if calls is not None:
            raise InvalidRequest("echo", 'cannot be used with tools: give tool_choice "none"')
        last = request.chat.messages[-1]
        echoed = last.content if last.role == "assistant" else ""
    held = request.output_format.WhichOneof("format") is not None
    return dataclasses.replace(
        plan,
        calls=calls,
        format_param=param or plan.format_param,
        chat_echo=echoed,
        reasoning=reasons and not held,
    )


def completion_plan(body: CompletionRequest, request_id: str, model_name: str) -> Plan:
    if body.suffix:
        raise InvalidRequest("suffix", "is not supported yet")
    prompts = _prompts(body.prompt)
    template = _common(body, request_id, model_name)
    if body.max_tokens == 0 and not body.echo:
        raise InvalidRequest("max_tokens", "may be 0 only with echo: true (the prompt alone)")
    if body.max_tokens is not None:
        # With max_tokens 0 one token is made (a request generates) and left out of the answer.
        template.max_tokens = max(body.max_tokens, 1)
    requests = []
    for p, prompt in enumerate(prompts):
        request = pb.GenerateRequest()
        request.CopyFrom(template)
        if len(prompts) > 1:
            request.request_id = f"{request_id}:{p}"
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.ids.extend(prompt)
        requests.append(request)
    plan = _plan(body, requests, body.logprobs)
    echo = bool(body.echo)
    if echo and plan.top_logprobs is not None:
        if plan.stream and plan.n > 1:
            # Only the first sequence of a prompt scores it: the others' first chunks would wait.
            raise InvalidRequest("n", "must be 1 to stream an echoed prompt's logprobs")
        for request in requests:  # the echoed prompt's tokens come with their logprobs
            request.prompt_logprobs = plan.top_logprobs
    plan = _score_prompts(plan, body.prompt_logprobs)
    return dataclasses.replace(plan, echo=echo, generates=body.max_tokens != 0)


def _score_prompts(plan: Plan, top: int | None) -> Plan:
    """vLLM's prompt_logprobs: each request scores its prompt, with at least `top` alternatives."""
    if top is None:
        return plan
    if plan.stream:
        raise InvalidRequest("prompt_logprobs", "is answered whole: not with stream: true")
    for request in plan.requests:
        has = request.prompt_logprobs if request.HasField("prompt_logprobs") else 0
        request.prompt_logprobs = max(has, top)
    return dataclasses.replace(plan, prompt_logprobs=top)


def tokenize_request(
    body: TokenizeRequest, model_name: str, tool_form: ToolFormat = LLAMA_JSON
) -> pb.TokenizeRequest:
    """A chat's ids are those a chat completion of it runs: its earlier tool calls written as
    there, its tools shown as there with a tool_choice other than "none"."""
    check_served_model(body.model, model_name)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequest("prompt", "give either a prompt or messages")
    request = pb.TokenizeRequest(model=body.model or "")
    if body.messages is not None:
        _add_messages(request.chat, body.messages, tool_form)
        _add_rendering(request.chat, body)
        if body.tools:
            request.chat.tools = tools_json(body.tools)
    else:
        names = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools")
        for name in names:
            if getattr(body, name) is not None:
                raise InvalidRequest(name, "renders messages: give messages, not a prompt")
        request.text = body.prompt or ""
    return request


def _add_rendering(chat: pb.ChatMessages, body: _Rendering) -> None:
    if body.add_generation_prompt is not None:
        chat.add_generation_prompt = body.add_generation_prompt
    chat.continue_final_message = bool(body.continue_final_message)
    if body.chat_template_kwargs:
        chat.chat_template_kwargs = json.dumps(body.chat_template_kwargs, ensure_ascii=False)


def detokenize_request(
    body: DetokenizeRequest, model_name: str, vocab_size: int
) -> pb.DetokenizeRequest:
    check_served_model(body.model, model_name)
    bad = [t for t in body.tokens if t >= vocab_size]
    if bad:
        raise InvalidRequest("tokens", f"ids {bad[:5]} are outside [0, {vocab_size})")
    return pb.DetokenizeRequest(model=body.model or "", token_ids=body.tokens)


def _add_messages(
    chat: pb.ChatMessages, messages: list[ChatMessage], tool_form: ToolFormat = LLAMA_JSON
) -> None:
    """Text messages into the gRPC API's chat; what is not text is refused. An assistant's tool
    calls go to a template that shows them (in its model's form), or else become its text, in
    the form tool_choice "required" or "auto" holds a reply to."""
    for i, message in enumerate(messages):
        content = _text(message.content, f"messages[{i}].content")
        role = _ROLES.get(message.role, message.role)
        if not message.tool_calls:
            chat.messages.add(role=role, content=content, tool_call_id=message.tool_call_id or "")
            continue
        written: list[tuple[str, Any]] = []  # (name, arguments)
        for j, call in enumerate(message.tool_calls):
            field = f"messages[{i}].tool_calls[{j}].function.arguments"
            try:
                arguments = json.loads(call.function.arguments)
            except json.JSONDecodeError as err:
                raise InvalidRequest(field, f"is not JSON: {err}") from None
            if not isinstance(arguments, dict):
                raise InvalidRequest(field, "must be a JSON object")
            written.append((call.function.name, arguments))
        if tool_form.in_template:
            calls = [
                {"type": "function", "function": {"name": name, "arguments": arguments}}
                | _id(call.id)
                for (name, arguments), call in zip(written, message.tool_calls, strict=True)
            ]
            listed = json.dumps(calls, ensure_ascii=False)
            chat.messages.add(role="assistant", content=content, tool_calls=listed)
            continue
        text = tool_form.write(written)
        said = f"{content}\n{text}" if content else text
        chat.messages.add(role="assistant", content=said)


def _id(call_id: str | None) -> dict[str, str]:
    # A call without an id has none in the template's eyes (Mistral's then names the problem).
    return {"id": call_id} if call_id is not None else {}


def _text(content: str | list[ContentPart] | None, field: str) -> str:
    if not isinstance(content, list):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise InvalidRequest(
                f"{field}[{j}].type", f"{part.type!r} content is not supported yet: only text"
            )
        texts.append(part.text)
    return "\n".join(texts)


def _plan(body: _Sampling, requests: list[pb.GenerateRequest], top: int | None) -> Plan:
    options = body.stream_options
    if options is not None and not body.stream:
        raise InvalidRequest("stream_options", "is only allowed with stream: true")
    if top is not None:
        for request in requests:
            request.logprobs = max(top, 1)  # the sampled token's own logprob comes with the top-1
    return Plan(
        requests=requests,
        n=requests[0].n or 1,
        stream=bool(body.stream),
        include_usage=bool(options and options.include_usage),
        continuous_usage=bool(options and options.continuous_usage_stats),
        top_logprobs=top,
        chat=isinstance(body, ChatCompletionRequest),
        format_param=format_param(body),
        token_ids_as_text=bool(body.return_tokens_as_token_ids),
    )


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequest("prompt", "is empty")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    if len(prompt) > MAX_PROMPTS:
        raise InvalidRequest("prompt", f"at most {MAX_PROMPTS} prompts in one request")
    return list(prompt)  # type: ignore[arg-type]


def check_served_model(model: str | None, model_name: str) -> None:
    if model and model != model_name:
        raise NotFound("model", f"the model {model!r} does not exist; this server serves "
                       f"{model_name!r}")  # fmt: skip


def _common(body: _Sampling, request_id: str, model_name: str) -> pb.GenerateRequest:
    check_served_model(body.model, model_name)
    if body.best_of not in (None, 1):
        raise InvalidRequest("best_of", "is not supported yet (n sequences are: use n)")
    request = pb.GenerateRequest(
        model=body.model or "",
        request_id=request_id,
        n=body.n or 1,
        min_tokens=body.min_tokens or 0,
        ignore_eos=bool(body.ignore_eos),
        priority=body.priority or 0,
        session_id=body.session_id or "",
    )
    if body.skip_special_tokens is not None:
        request.skip_special_tokens = body.skip_special_tokens
    request.include_stop_str_in_output = bool(body.include_stop_str_in_output)
    request.truncate_prompt_tokens = body.truncate_prompt_tokens or 0
    s = request.sampling
    if body.top_k is not None:
        s.top_k = max(body.top_k, 0)  # vLLM's -1 is our 0: off
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
    ):
        value = getattr(body, name)
        if value is not None:
            if abs(value) > _FLOAT32_MAX:  # the gRPC API's float would make it inf
                raise InvalidRequest(name, f"must be a finite number, got {value!r}")
            setattr(s, name, value)
    if body.seed is not None:
        if not 0 <= body.seed < 2**63:
            raise InvalidRequest("seed", f"must be in [0, 2**63), got {body.seed}")
        s.seed = body.seed
    for key, bias in (body.logit_bias or {}).items():
        token_id = int(key)  # the schema let only digits through
        if not 0 <= token_id < 2**31:
            raise InvalidRequest("logit_bias", f"{token_id} is not a token id")
        s.logit_bias[token_id] = bias
    if body.allowed_token_ids:
        s.allowed_token_ids.extend(body.allowed_token_ids)
    stop = body.stop
    if stop is not None:
        request.stop.extend([stop] if isinstance(stop, str) else stop)
    if body.stop_token_ids:
        request.stop_token_ids.extend(body.stop_token_ids)
    if body.bad_words:
        request.bad_words.extend(body.bad_words)
    add_output_format(request.output_format, body)
    return request


def _refuse_unsupported_chat(body: ChatCompletionRequest) -> None:
    if body.functions:
        raise InvalidRequest("functions", "is not supported (OpenAI's older form): give tools")
    if body.function_call is not None and body.function_call != "none":
        raise InvalidRequest("function_call", "is not supported (OpenAI's older form): give tools")
    if body.modalities is not None and body.modalities != ["text"]:
        raise InvalidRequest("modalities", "only text is supported")
    for name in ("audio", "prediction", "reasoning_effort"):
        if getattr(body, name) is not None:
            raise InvalidRequest(name, "is not supported yet")
