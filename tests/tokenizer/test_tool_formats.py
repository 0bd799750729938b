"""Tool calls in a model family's own form (hermes' <tool_call> tags, mistral's [TOOL_CALLS]
list): the form read off the chat template, replies held to it by llguidance, read back into
OpenAI's tool_calls, whole and streamed."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import llguidance
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from engine.guided import OutputFormat, compile_format, grammar_tokenizer
from engine.tokenizer import ChatTemplate, Tokenizer, load_tokenizer
from services.client_types import generate_request
from services.tokenizer.http.convert import Plan, chat_plan
from services.tokenizer.http.schemas import ChatCompletionRequest
from services.tokenizer.http.tool_formats import (
    HERMES,
    JSON,
    MISTRAL,
    MISTRAL_ARGS,
    ToolFormat,
    detect,
    not_beginning,
)
from services.tokenizer.request import parse_generate
from services.tokenizer.stream import TextStream
from tandem.internal.v1 import hotpath_pb2 as hp
from tests.tokenizer.streamed import streamed

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ROME = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
TAGGED = f"<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>\n{ROME}\n</tool_call>"
LISTED = f"[TOOL_CALLS] [{PARIS}, {ROME}]"
NAMED = (
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}'
)
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}
HERMES_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if tools %}Answer with <tool_call>{...}</tool_call>{% endif %}<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def vocabulary(default_gguf: Path) -> tuple[Tokenizer, llguidance.LLTokenizer]:
    tokenizer = load_tokenizer(default_gguf)
    return tokenizer, grammar_tokenizer(tokenizer, tokenizer.vocab_size)


def plan_of(form: ToolFormat, **body: Any) -> Plan:
    messages = [{"role": "user", "content": "x"}]
    request = ChatCompletionRequest.model_validate({"messages": messages, **body})
    return chat_plan(request, "r", "m", form)


def holds(
    vocabulary: tuple[Tokenizer, llguidance.LLTokenizer], grammar: str, ids: list[int]
) -> bool:
    """Whether the grammar lets a reply of exactly these tokens end there."""
    _, lltokenizer = vocabulary
    matcher = llguidance.LLMatcher(
        lltokenizer, compile_format(OutputFormat("grammar", grammar), lltokenizer)
    )
    return matcher.validate_tokens(ids) == len(ids) and (
        matcher.consume_tokens(ids) and matcher.is_accepting()
    )


def test_the_form_is_read_off_the_chat_template(vocabulary: tuple[Tokenizer, Any]) -> None:
    assert detect("{{ tools }} reply inside <tool_call></tool_call> tags") == HERMES
    assert detect("{{ '[AVAILABLE_TOOLS]' }}...{{ '[TOOL_CALLS] ' }}") == MISTRAL
    assert detect("{{ '[TOOL_CALLS]' + name + '[ARGS]' + arguments }}") == MISTRAL_ARGS
    assert detect('Respond in JSON: {"name": ..., "parameters": ...}') == JSON
    tokenizer, _ = vocabulary
    assert ToolFormat.of(tokenizer).name == JSON  # the default model's template shows neither
    hermes = copy.copy(tokenizer)
    hermes.chat_template = ChatTemplate(HERMES_TEMPLATE)
    assert ToolFormat.of(hermes) == ToolFormat(HERMES)  # its markers are text here
    assert ToolFormat.of(hermes, "mistral").name == MISTRAL  # the flag wins
    with pytest.raises(ValueError, match="unknown tool call format 'xml'"):
        ToolFormat.of(tokenizer, "xml")


@given(st.text(alphabet="<tol_ca>[TOLS]x", max_size=14))
@example("<tool_call>")
@example("<tool_call")
@example("[TOOL_CALLS] [")
def test_text_not_beginning_as_calls_is_exactly_that(text: str) -> None:
    for marker in ("<tool_call>", "[TOOL_CALLS]"):
        matched = re.fullmatch(not_beginning(marker), text) is not None
        assert matched == (bool(text) and not text.startswith(marker))


@pytest.mark.parametrize(
    ("name", "calls"), [(HERMES, TAGGED), (MISTRAL, LISTED), (MISTRAL_ARGS, NAMED)]
)
def test_replies_are_held_to_the_form_and_read_back(
    vocabulary: tuple[Tokenizer, llguidance.LLTokenizer], name: str, calls: str
) -> None:
    tokenizer, _ = vocabulary
    form = ToolFormat.of(tokenizer, name)
    encode = lambda text: tokenizer.encode(text, allow_special=False)  # noqa: E731
    required = plan_of(form, tools=[WEATHER], tool_choice="required")
    grammar = required.requests[0].output_format.grammar
    assert holds(vocabulary, grammar, encode(calls))
    assert not holds(vocabulary, grammar, encode("It is sunny."))
    wrong = calls.replace('"city"', '"town"')  # arguments outside the tool's schema
    assert not holds(vocabulary, grammar, encode(wrong))
    single = plan_of(form, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert not holds(vocabulary, single.requests[0].output_format.grammar, encode(calls))
    auto = plan_of(form, tools=[WEATHER]).requests[0].output_format.grammar
    assert holds(vocabulary, auto, encode(calls)) and holds(vocabulary, auto, encode("Hi."))
    opening = calls[:12]  # text may not begin as calls do, then break the form
    assert not holds(vocabulary, auto, encode(opening + " no call"))
    assert holds(vocabulary, auto, encode(opening[:5] + " x"))  # a marker's start is text
    assert required.calls is not None
    assert required.calls.read(calls) == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"name": "get_weather", "arguments": '{"city": "Rome"}'},
    ]
    assert required.calls.read(calls[:-3]) is None  # cut short: no calls
    assert not required.requests[0].HasField("skip_special_tokens")  # markers of text


def test_each_name_before_args_is_held_to_its_own_tools_arguments(
    vocabulary: tuple[Tokenizer, llguidance.LLTokenizer],
) -> None:
    """mistral-args writes the name as text before [ARGS]: the arguments that follow are held
    to that tool's schema, not another's, and a name that is no tool's is refused."""
    tokenizer, _ = vocabulary
    encode = lambda text: tokenizer.encode(text, allow_special=False)  # noqa: E731
    plan = plan_of(ToolFormat(MISTRAL_ARGS), tools=[WEATHER, CLOCK], tool_choice="required")
    grammar = plan.requests[0].output_format.grammar
    weather = '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'
    assert holds(vocabulary, grammar, encode(weather + "[TOOL_CALLS]clock[ARGS]{}"))
    assert not holds(vocabulary, grammar, encode("[TOOL_CALLS]get_weather[ARGS]{}"))
    assert not holds(vocabulary, grammar, encode('[TOOL_CALLS]radio[ARGS]{"city": "Oslo"}'))
    assert plan.calls is not None
    assert plan.calls.read(weather + "[TOOL_CALLS]clock[ARGS]{}") == [
        {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"name": "clock", "arguments": "{}"},
    ]
    assert plan.calls.read("[TOOL_CALLS]get_weather") is None  # cut before its arguments


def test_a_marker_the_vocabulary_holds_is_held_as_its_special_token(
    vocabulary: tuple[Tokenizer, llguidance.LLTokenizer],
) -> None:
    """Where "<tool_call>" is one special token, the reply must write that token (its text
    would be other tokens), and keeps special tokens' text so it can be read back."""
    tokenizer, _ = vocabulary
    # Stand-ins for the tags' tokens: special, and not the end of a sequence.
    opening, closing = (tokenizer.special_id(t) for t in ("<jupyter_code>", "<jupyter_output>"))
    assert opening is not None and closing is not None
    form = ToolFormat(HERMES, (("<tool_call>", opening), ("</tool_call>", closing)))
    plan = plan_of(form, tools=[WEATHER])
    (request,) = plan.requests
    assert request.HasField("skip_special_tokens") and not request.skip_special_tokens
    body = tokenizer.encode(f"\n{PARIS}\n", allow_special=False)
    grammar = request.output_format.grammar
    assert holds(vocabulary, grammar, [opening, *body, closing])
    spelled = tokenizer.encode(TAGGED, allow_special=False)  # the tags as text
    required = plan_of(form, tools=[WEATHER], tool_choice="required")
    assert not holds(vocabulary, required.requests[0].output_format.grammar, spelled)
    assert not holds(vocabulary, grammar, spelled)  # nor text that begins as calls do
    assert holds(vocabulary, grammar, tokenizer.encode("It is <tool_call>", allow_special=False))


def test_a_streamed_auto_reply_waits_for_its_beginning_to_tell(
    vocabulary: tuple[Tokenizer, Any],
) -> None:
    """A marker's first characters could begin either: they are held until the text tells,
    then sent as text, or the reply is calls, sent whole at its end."""
    tokenizer, _ = vocabulary
    plan = plan_of(ToolFormat(HERMES), tools=[WEATHER], stream=True)
    text = streamed(plan, tokenizer, "<to", "o", "ls are", " here.")
    contents = [c["delta"].get("content") for c in text]
    assert contents[1:3] == [None, None]  # "<to", "<too": either yet
    assert "".join(c or "" for c in contents) == "<tools are here."
    assert contents[3] == "<tools are"  # what was held, at once
    calls = streamed(plan, tokenizer, "<tool", "_call>\n", PARIS, "\n</tool_call>")
    assert not any(c["delta"].get("content") for c in calls)
    (call,) = calls[-1]["delta"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert calls[-1]["finish_reason"] == "tool_calls"
    cut = streamed(plan, tokenizer, "<tool")  # ended while either: text
    assert cut[-1]["delta"] == {"content": "<tool"} and cut[-1]["finish_reason"] == "stop"


@pytest.mark.parametrize("name", [JSON, HERMES, MISTRAL, MISTRAL_ARGS])
def test_an_earlier_turns_calls_are_shown_in_the_form_they_are_read_in(name: str) -> None:
    form = ToolFormat(name)
    calls = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Zürich"})]
    for said in (calls[:1], calls):
        text = form.write(said)
        read = [{"name": n, "arguments": json.dumps(a, ensure_ascii=False)} for n, a in said]
        assert form.read(text) == read
    earlier = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for n, a in calls
        ],
    }
    messages = [{"role": "user", "content": "x"}, earlier, {"role": "tool", "content": "ok"}]
    request = ChatCompletionRequest.model_validate({"messages": messages})
    (shown,) = [m for m in chat_plan(request, "r", "m", form).requests[0].chat.messages][1:2]
    assert shown.role == "assistant" and form.read(shown.content) is not None
    assert shown.content.startswith(
        {JSON: "[", HERMES: "<tool_call>", MISTRAL: "[TOOL_CALLS]", MISTRAL_ARGS: "[TOOL_CALLS]"}[
            name
        ]
    )


def test_a_request_may_keep_special_tokens_text(vocabulary: tuple[Tokenizer, Any]) -> None:
    """skip_special_tokens (vLLM's): unset or true, a special token the model writes leaves no
    text; false keeps it (what a marker held as its special token is read back by)."""
    tokenizer, _ = vocabulary
    marker = tokenizer.special_id("<jupyter_code>")
    assert marker is not None
    hi = tokenizer.encode("hi", allow_special=False)
    events = hp.RequestEvents(request_id="r", token_ids=[marker, *hi], finish_reason="length")
    texts = []
    for keep in (None, True, False):
        request = generate_request("x", skip_special_tokens=keep)
        assert request.HasField("skip_special_tokens") == (keep is not None)
        spec = parse_generate(request, "", tokenizer.vocab_size, 8192)
        texts.append(TextStream(tokenizer, spec, frozenset()).on_events(events).text)
    assert texts == ["hi", "hi", "<jupyter_code>hi"]


@pytest.mark.parametrize(
    ("template", "name", "calls", "without_id"),
    [
        (  # Mistral 7B v0.3's and NeMo's: the id last in each call's object
            "{{ '[TOOL_CALLS][' }}{{ out[:-1] }}{{ ', \"id\": \"' + tool_call.id + '\"}' }}",
            MISTRAL,
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, '
            '"id": "a1B2c3D4e"}]',
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        ),
        (  # Mistral Small 3.2's: [CALL_ID]id between the name and [ARGS]
            "{{ '[TOOL_CALLS]' + name + '[CALL_ID]' + tool_call.id + '[ARGS]' + arguments }}",
            MISTRAL_ARGS,
            '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}',
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
        ),
    ],
)
def test_a_call_id_the_template_shows_is_written_by_the_model_and_answered(
    vocabulary: tuple[Tokenizer, llguidance.LLTokenizer],
    template: str,
    name: str,
    calls: str,
    without_id: str,
) -> None:
    """Where the template shows each earlier call's id as the model wrote it, the model writes
    one (9 letters and digits, held so), and the reply answers with it."""
    tokenizer, _ = vocabulary
    shown = copy.copy(tokenizer)
    shown.chat_template = ChatTemplate(template)
    form = ToolFormat.of(shown)
    assert form.name == name and form.writes_ids
    encode = lambda text: tokenizer.encode(text, allow_special=False)  # noqa: E731
    plan = plan_of(form, tools=[WEATHER], tool_choice="required")
    grammar = plan.requests[0].output_format.grammar
    assert holds(vocabulary, grammar, encode(calls))
    assert not holds(vocabulary, grammar, encode(without_id))
    assert not holds(vocabulary, grammar, encode(calls.replace("a1B2c3D4e", "call_1")))
    (reply,) = streamed(plan, tokenizer, calls)[-1:]
    (call,) = reply["delta"]["tool_calls"]
    assert call["id"] == "a1B2c3D4e"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert not ToolFormat(name).writes_ids  # a template that shows no ids: tandem makes them
