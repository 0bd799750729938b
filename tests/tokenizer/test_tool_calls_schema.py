"""The calls' schema holds a tool's arguments exactly as the tool's own schema does: for
schemas drawn by Hypothesis (objects, arrays, enums, $defs and references to them and into the
document, annotations), an instance is valid for the tool iff its call is valid for the calls."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
from hypothesis import given, settings
from hypothesis import strategies as st

from services.tokenizer.http.convert import chat_plan
from services.tokenizer.http.schemas import ChatCompletionRequest

NAMES = st.sampled_from(["a", "b", "description", "title", "items"])  # keywords as names too
ANNOTATED = st.fixed_dictionaries(
    {}, optional={"description": st.text(max_size=5), "title": st.just("T")}
)


def leaves() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.just({"type": "string"}),
        st.builds(lambda lo: {"type": "integer", "minimum": lo}, st.integers(-2, 2)),
        st.builds(lambda v: {"enum": v}, st.lists(st.integers(0, 3), min_size=1, max_size=3)),
        st.just({"$ref": "#/$defs/leaf"}),
    )


def schemas(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    objects = st.builds(
        lambda props, required, closed: {
            "type": "object",
            "properties": props,
            "required": sorted(set(required) & set(props)),
            "additionalProperties": not closed,
        },
        st.dictionaries(NAMES, children, max_size=3),
        st.lists(NAMES, max_size=3),
        st.booleans(),
    )
    arrays = st.builds(
        lambda item, n: {"type": "array", "items": item, "maxItems": n}, children, st.integers(0, 2)
    )
    return st.builds(lambda s, notes: {**s, **notes}, st.one_of(objects, arrays), ANNOTATED)


TOOL_SCHEMAS = st.recursive(leaves(), schemas, max_leaves=6).map(
    lambda s: {
        **(s if s.get("type") == "object" else {"type": "object", "properties": {"x": s}}),
        "$defs": {"leaf": {"type": "integer", "maximum": 5, "description": "d"}},
    }
)
VALUES = st.recursive(
    st.one_of(st.integers(-3, 7), st.sampled_from(["s", ""])),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(NAMES | st.just("x"), inner, max_size=3)
    ),
    max_leaves=8,
)


def valid(instance: Any, schema: dict[str, Any]) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


@settings(max_examples=150, deadline=None)
@given(TOOL_SCHEMAS, st.lists(VALUES.filter(lambda v: isinstance(v, dict)), min_size=1, max_size=4))
def test_a_call_is_valid_exactly_when_its_arguments_are(
    parameters: dict[str, Any], instances: list[dict[str, Any]]
) -> None:
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": parameters}},
        {"type": "function", "function": {"name": "g"}},
    ]
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "tools": tools, "tool_choice": "required"}
    )
    calls = json.loads(chat_plan(body, "r", "m").requests[0].output_format.json_schema)
    for instance in instances:
        call = {"name": "f", "parameters": instance}
        assert valid(call, calls) == valid(instance, parameters), (instance, calls)
        assert valid([call, {"name": "g", "parameters": {}}], calls) == valid(instance, parameters)
