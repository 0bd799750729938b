"""A Generate request, validated field by field before any tokenizing, as a plain dataclass."""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from engine.errors import ContextLengthExceeded, InvalidRequest
from engine.guided import OutputFormat
from engine.sampling_params import MAX_LOGPROBS, SamplingParams
from tandem.v1 import generation_pb2 as pb

DEFAULT_MAX_TOKENS = 256
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_STOP_TOKEN_IDS = 1024  # a request's set lives as long as it does, queued ones included
MAX_BAD_WORDS = 32
MAX_ID_LENGTH = 128  # request_id, session_id
# A prompt's text can hardly carry fewer than this many characters per token; longer text
# could never fit the context, so it is refused before the tokenizer spends time on it.
MAX_CHARS_PER_TOKEN = 64
ROLES = ("system", "user", "assistant", "tool")
MAX_N = 16  # sequences from one prompt


@dataclass(frozen=True)
class ChatRendering:
    """How a chat is rendered besides its messages and tools (ChatMessages' options)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    variables: dict[str, Any] = field(default_factory=dict)  # more of the template's


@dataclass(frozen=True)
class GenerateSpec:
    request_id: str
    text: str | None
    messages: list[dict[str, Any]] | None
    prompt_ids: list[int] | None
    sampling: SamplingParams
    max_tokens: int | None  # None: DEFAULT_MAX_TOKENS, within the context
    stop_strings: tuple[str, ...]
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    priority: int
    session_id: str | None
    split_special_tokens: bool = False
    skip_special_tokens: bool = True  # special tokens the model writes leave no text
    include_stop_str: bool = False  # the stop string that ended the text stays in it
    bad_words: tuple[str, ...] = ()  # words the output may not contain (tokenized on admission)
    keep_prompt_tokens: int | None = None  # the prompt cut to its last this many; None: whole
    n: int = 1  # sequences from the prompt, each its own scheduler request
    output_format: OutputFormat | None = None  # None: free text
    tools: list[Any] | None = None  # for the chat template (OpenAI's form)
    rendering: ChatRendering = field(default_factory=ChatRendering)


TRUNCATE_HINT = " (truncate_prompt_tokens keeps only its last ones)"


def _kept_prompt_tokens(asked: int, max_seq_len: int) -> int | None:
    """How many of the prompt's last tokens truncate_prompt_tokens keeps; None: all."""
    if asked == 0:
        return None
    if asked == -1:
        return max_seq_len - 1  # the most that leaves a token to generate
    if not 1 <= asked < max_seq_len:
        raise InvalidRequest(
            "truncate_prompt_tokens",
            f"must be -1 or in [1, {max_seq_len - 1}] (the context is {max_seq_len}), got {asked}",
        )
    return asked


def check_model(name: str, model_name: str) -> None:
    if name and name != model_name:
        raise InvalidRequest("model", f"unknown model {name!r}; this server serves {model_name!r}")


def _check_ids(field: str, ids: Iterable[int], vocab_size: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(field, f"ids {bad[:5]} are outside [0, {vocab_size})")


def _sampling(req: pb.GenerateRequest, vocab_size: int) -> SamplingParams:
    s = req.sampling
    _check_ids("sampling.logit_bias", s.logit_bias, vocab_size)
    _check_ids("sampling.allowed_token_ids", s.allowed_token_ids, vocab_size)

    def get(name: str, default: float) -> float:
        value = getattr(s, name) if s.HasField(name) else default
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidRequest(name, f"must be a finite number, got {value}")  # prefixed below
        return value

    try:
        return SamplingParams(
            temperature=get("temperature", 1.0),
            top_p=get("top_p", 1.0),
            top_k=int(get("top_k", 0)),
            min_p=get("min_p", 0.0),
            repetition_penalty=get("repetition_penalty", 1.0),
            presence_penalty=get("presence_penalty", 0.0),
            frequency_penalty=get("frequency_penalty", 0.0),
            seed=s.seed if s.HasField("seed") else None,
            logprobs=req.logprobs,
            logit_bias=tuple(sorted(s.logit_bias.items())),
            min_tokens=req.min_tokens,
            prompt_logprobs=req.prompt_logprobs if req.HasField("prompt_logprobs") else None,
            allowed_token_ids=tuple(sorted(set(s.allowed_token_ids))),
        )
    except InvalidRequest as err:
        top_level = err.field in ("logprobs", "min_tokens", "prompt_logprobs")
        field = err.field if top_level else f"sampling.{err.field}"
        raise InvalidRequest(field, str(err).split(": ", 1)[1]) from None


def parse_generate(
    req: pb.GenerateRequest, model_name: str, vocab_size: int, max_seq_len: int
) -> GenerateSpec:
    """Check every field that can be checked without tokenizing; raise InvalidRequest naming it."""
    check_model(req.model, model_name)
    kind = req.WhichOneof("prompt")
    text = messages = prompt_ids = tools = None
    rendering = ChatRendering()
    max_chars = max_seq_len * MAX_CHARS_PER_TOKEN
    if kind is None:
        raise InvalidRequest("prompt", "is empty: set text, chat or token_ids")
    if kind == "text":
        if not req.text:
            raise InvalidRequest("prompt.text", "is empty")
        if len(req.text) > max_chars:
            raise ContextLengthExceeded(
                "prompt.text", f"{len(req.text)} characters cannot fit the context"
            )
        text = req.text
    elif kind == "chat":
        messages = chat_messages(req.chat, max_chars)
        tools = chat_tools(req.chat, max_chars)
        rendering = chat_rendering(req.chat, max_chars)
    keep = _kept_prompt_tokens(req.truncate_prompt_tokens, max_seq_len)
    if kind == "token_ids":
        prompt_ids = list(req.token_ids.ids)
        if not prompt_ids:
            raise InvalidRequest("prompt.token_ids", "is empty")
        _check_ids("prompt.token_ids", prompt_ids, vocab_size)
        if keep is not None:
            prompt_ids = prompt_ids[-keep:]
        if len(prompt_ids) >= max_seq_len:
            raise ContextLengthExceeded(
                "prompt.token_ids",
                f"{len(prompt_ids)} tokens do not fit the context of {max_seq_len}{TRUNCATE_HINT}",
            )
    max_tokens = req.max_tokens if req.HasField("max_tokens") else None
    if max_tokens is not None:
        if max_tokens <= 0:
            raise InvalidRequest("max_tokens", f"must be positive, got {max_tokens}")
        if max_tokens >= max_seq_len:
            raise InvalidRequest(
                "max_tokens", f"{max_tokens} is beyond the model's context of {max_seq_len}"
            )
        if req.min_tokens > max_tokens:
            raise InvalidRequest(
                "min_tokens", f"{req.min_tokens} is more than max_tokens ({max_tokens})"
            )
    if not 0 <= req.n <= MAX_N:
        raise InvalidRequest("n", f"must be in [1, {MAX_N}], got {req.n}")
    if not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise InvalidRequest("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {req.logprobs}")
    if len(req.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LENGTH for s in req.stop):
        raise InvalidRequest(
            "stop", f"at most {MAX_STOP_STRINGS} stop strings of {MAX_STOP_LENGTH} characters"
        )
    if len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(
            "stop_token_ids",
            f"{len(req.stop_token_ids)} ids given, at most {MAX_STOP_TOKEN_IDS}",
        )
    _check_ids("stop_token_ids", req.stop_token_ids, vocab_size)
    if len(req.bad_words) > MAX_BAD_WORDS or any(len(w) > MAX_STOP_LENGTH for w in req.bad_words):
        raise InvalidRequest(
            "bad_words", f"at most {MAX_BAD_WORDS} words of {MAX_STOP_LENGTH} characters"
        )
    if any(not w.strip() for w in req.bad_words):
        raise InvalidRequest("bad_words", "a word is empty")
    if req.bad_words and req.sampling.allowed_token_ids:
        raise InvalidRequest("bad_words", "not with allowed_token_ids: list only the tokens wanted")
    for name in ("request_id", "session_id"):
        if len(getattr(req, name)) > MAX_ID_LENGTH:
            raise InvalidRequest(
                name, f"{len(getattr(req, name))} characters, at most {MAX_ID_LENGTH}"
            )
    return GenerateSpec(
        request_id=req.request_id or uuid.uuid4().hex,
        text=text,
        messages=messages,
        prompt_ids=prompt_ids,
        sampling=_sampling(req, vocab_size),
        max_tokens=max_tokens,
        stop_strings=tuple(s for s in req.stop if s),
        stop_token_ids=frozenset(req.stop_token_ids),
        ignore_eos=req.ignore_eos,
        priority=req.priority,
        session_id=req.session_id or None,
        split_special_tokens=req.split_special_tokens,
        skip_special_tokens=not req.HasField("skip_special_tokens") or req.skip_special_tokens,
        include_stop_str=req.include_stop_str_in_output,
        bad_words=tuple(req.bad_words),
        keep_prompt_tokens=keep,
        n=req.n or 1,
        output_format=_output_format(req),
        tools=tools,
        rendering=rendering,
    )


def chat_tools(chat: pb.ChatMessages, max_chars: int) -> list[Any] | None:
    """The chat's tools as the template takes them; None without."""
    if not chat.tools:
        return None
    if len(chat.tools) > max_chars:
        raise ContextLengthExceeded(
            "prompt.chat.tools", f"{len(chat.tools)} characters cannot fit the context"
        )
    try:
        tools = json.loads(chat.tools)
    except json.JSONDecodeError as err:
        raise InvalidRequest("prompt.chat.tools", f"is not JSON: {err}") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise InvalidRequest("prompt.chat.tools", "must be a JSON list of objects")
    return tools


def chat_rendering(chat: pb.ChatMessages, max_chars: int) -> ChatRendering:
    """The chat's rendering options; its template variables checked to be a JSON object."""
    variables: Any = {}
    if chat.chat_template_kwargs:
        name = "prompt.chat.chat_template_kwargs"
        if len(chat.chat_template_kwargs) > max_chars:
            raise InvalidRequest(name, f"{len(chat.chat_template_kwargs)} characters are too many")
        try:
            variables = json.loads(chat.chat_template_kwargs)
        except json.JSONDecodeError as err:
            raise InvalidRequest(name, f"is not JSON: {err}") from None
        if not isinstance(variables, dict):
            raise InvalidRequest(name, "must be a JSON object (variable names to values)")
    return ChatRendering(
        add_generation_prompt=(  # unset: true, unless the last message is to be continued
            chat.add_generation_prompt
            if chat.HasField("add_generation_prompt")
            else not chat.continue_final_message
        ),
        continue_final_message=chat.continue_final_message,
        variables=variables,
    )


def _output_format(req: pb.GenerateRequest) -> OutputFormat | None:
    fmt = req.output_format
    kind = fmt.WhichOneof("format") if req.HasField("output_format") else None
    if kind is None or (kind == "json_object" and not fmt.json_object):
        return None
    # The sequence ends once the format is complete: only an end-of-sequence token may follow.
    if req.ignore_eos:
        raise InvalidRequest("ignore_eos", "cannot be used with an output_format")
    if req.min_tokens:
        raise InvalidRequest("min_tokens", "must be 0 with an output_format")
    if req.sampling.allowed_token_ids:
        raise InvalidRequest("sampling.allowed_token_ids", "must be empty with an output_format")
    if req.bad_words:
        raise InvalidRequest("bad_words", "must be empty with an output_format")
    field = f"output_format.{kind}"
    if kind == "json_object":
        return OutputFormat("json_object", field=field)
    if kind == "choice":
        return OutputFormat("choice", tuple(fmt.choice.choices), field=field)
    return OutputFormat(kind, getattr(fmt, kind), field=field)


def chat_messages(chat: pb.ChatMessages, max_chars: int) -> list[dict[str, Any]]:
    if not chat.messages:
        raise InvalidRequest("prompt.chat", "has no messages")
    total = 0
    out = []
    for i, message in enumerate(chat.messages):
        if message.role not in ROLES:
            raise InvalidRequest(
                f"prompt.chat.messages[{i}].role",
                f"{message.role!r} is not one of {', '.join(ROLES)}",
            )
        total += len(message.content) + len(message.tool_calls)
        said: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            said["tool_calls"] = _tool_calls(message.tool_calls, f"prompt.chat.messages[{i}]")
        if message.tool_call_id:
            said["tool_call_id"] = message.tool_call_id
        out.append(said)
    if total > max_chars:
        raise ContextLengthExceeded("prompt.chat", f"{total} characters cannot fit the context")
    return out


def _tool_calls(text: str, field: str) -> list[dict[str, Any]]:
    """An assistant's earlier calls, checked to be OpenAI's form with the arguments an object,
    as chat templates read them."""
    field += ".tool_calls"
    try:
        calls = json.loads(text)
    except json.JSONDecodeError as err:
        raise InvalidRequest(field, f"is not JSON: {err}") from None
    if not isinstance(calls, list):
        raise InvalidRequest(field, "must be a JSON list of calls")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequest(f"{field}[{j}]", 'must be {"function": {"name", "arguments"}}')
        if not isinstance(function.get("arguments", {}), dict):
            raise InvalidRequest(f"{field}[{j}].function.arguments", "must be a JSON object")
        if not isinstance(call.get("id", ""), str):
            raise InvalidRequest(f"{field}[{j}].id", "must be a string")
    return calls
