"""A chat request's tools and tool_choice as an output format (the calls' JSON, held to the
tools' schemas), and how a reply held to it becomes tool calls (`Calls`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequest
from engine.guided import JSON_LAYOUT
from services.tokenizer.http.schemas import ChatCompletionRequest, Tool
from services.tokenizer.http.tool_formats import JSON, LLAMA_JSON, ToolFormat
from tandem.v1 import generation_pb2 as pb

# JSON Schema's keywords by what their values are: annotations, which hold nothing; maps of
# names to schemas; lists of schemas; a schema.
_ANNOTATIONS = frozenset({"title", "description", "examples", "$comment", "default", "deprecated"})
_SCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)
_SCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
_SCHEMA_VALUES = frozenset(
    {
        "items", "additionalProperties", "not", "if", "then", "else", "contains",
        "propertyNames", "unevaluatedProperties", "unevaluatedItems", "additionalItems",
    }
)  # fmt: skip
_NOT_JSON = "TEXT: /[^\\[{][\\s\\S]*/"  # a reply that does not begin as calls do


@dataclass(frozen=True)
class Calls:
    """How a held output becomes tool calls: `function` named by tool_choice, the output being
    its arguments; or None, the output calls in the model's `form` (tool_choice "required"),
    or else text (tool_choice "auto": a reply that begins as calls do is calls, held to their
    schemas; any other is text)."""

    function: str | None
    form: ToolFormat = LLAMA_JSON
    auto: bool = False

    def read(self, text: str) -> list[dict[str, str]] | None:
        """The functions called (each {"name", "arguments"}, the arguments as JSON text) by a
        reply that ended by itself; None where it is text (or a stop string cut it)."""
        if self.function is not None:
            return [{"name": self.function, "arguments": text}]
        if self.auto and not self.form.verdict(text):
            return None
        return self.form.read(text)

    def verdict(self, text: str) -> bool | None:
        """Whether a reply beginning with `text` is calls; None while it cannot yet be told."""
        return self.form.verdict(text) if self.auto else True


def tool_calls(
    body: ChatCompletionRequest, request: pb.GenerateRequest, form: ToolFormat
) -> tuple[Calls | None, str | None]:
    """tools and tool_choice as an output format: calls in the model's form, held to their
    schemas."""
    tools = body.tools or []
    choice = body.tool_choice or ("auto" if tools else "none")
    if choice == "none":
        return None, None
    if not tools:
        raise InvalidRequest("tool_choice", "needs tools")
    if request.output_format.WhichOneof("format") is not None:
        # Both would hold the same reply: calls, and the form (often JSON too).
        said = json.dumps(choice) if isinstance(choice, str) else "a named function"
        if body.tool_choice is None:
            said += " (the default with tools)"
        raise InvalidRequest(
            "tool_choice",
            f"{said} cannot be combined with response_format or structured_outputs: give "
            '"none", or no tools',
        )
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        raise InvalidRequest("tools", "two tools have the same name")

    def arguments(tool: Tool) -> dict[str, Any]:
        return tool.function.parameters or {"type": "object", "properties": {}}

    # A template that renders tools shows them to the model (the default model's has no place).
    request.chat.tools = tools_json(tools)
    out = request.output_format
    if choice in ("required", "auto"):
        auto = choice == "auto"
        call = _call_schema([arguments(t) for t in tools], names, form.arguments_key, form.id_key)
        parallel = body.parallel_tool_calls is not False
        if form.keeps_special_tokens:  # the markers are special tokens: their text is read
            request.skip_special_tokens = False
        if form.name != JSON:
            out.grammar = form.grammar(call, parallel, auto)
            return Calls(None, form, auto), "tools"
        if parallel:
            listed = {"type": "array", "minItems": 1, "items": call}
            call = {"$defs": call.pop("$defs"), "anyOf": [call, listed]}
        if not auto:
            out.json_schema = json.dumps(call)
            return Calls(None, form), "tools"
        # Text, or calls: a reply's first character says which.
        call["x-guidance"] = JSON_LAYOUT
        out.grammar = f"start: TEXT | calls\ncalls: %json {json.dumps(call)}\n{_NOT_JSON}\n"
        return Calls(None, form, auto=True), "tools"
    assert not isinstance(choice, str)
    name = choice.function.name
    if name not in names:
        raise InvalidRequest(
            "tool_choice.function.name", f"{name!r} is none of the tools ({', '.join(names)})"
        )
    i = names.index(name)
    out.json_schema = json.dumps(arguments(tools[i]))
    return Calls(name, form), f"tools[{i}].function.parameters"


def tools_json(tools: list[Tool]) -> str:
    """The tools as the gRPC API's chat carries them to the template."""
    return json.dumps([t.model_dump(exclude_none=True) for t in tools])


def _call_schema(
    parameters: list[dict[str, Any]],
    names: list[str],
    arguments_key: str,
    id_key: str | None = None,
) -> dict[str, Any]:
    """A call of any of the tools, {"name", arguments_key} ("parameters" or "arguments") held
    to that tool's schema, and the call's id last where the model writes one (`id_key`). Each
    tool's schema is written once, under $defs (its own $defs with it, its references made to
    point there)."""
    defs: dict[str, Any] = {}
    for i, (schema, name) in enumerate(zip(parameters, names, strict=True)):
        own = {**schema}
        for key in ("$defs", "definitions"):
            held = own.pop(key, None) or {}
            if not isinstance(held, dict):
                raise InvalidRequest(f"tools[{i}].function.parameters.{key}", "is not an object")
            for sub, value in held.items():
                defs[f"t{i}_{sub}"] = _rebased(value, i)
        defs[f"t{i}"] = _rebased(own, i)
        properties = {"name": {"const": name}, arguments_key: {"$ref": f"#/$defs/t{i}"}}
        if id_key is not None:
            properties[id_key] = {"type": "string", "pattern": "^[A-Za-z0-9]{9}$"}
        defs[f"call{i}"] = {
            "type": "object",
            "properties": properties,
            "required": list(properties),
            "additionalProperties": False,
        }
    return {"$defs": defs, "anyOf": [{"$ref": f"#/$defs/call{i}"} for i in range(len(names))]}


def _rebased(schema: Any, i: int) -> Any:
    """`schema` (part of tool i's parameters) with each reference into its document made to
    point where _call_schema puts that document, and without the keywords that hold nothing
    (descriptions, titles: the model reads them in the tools, the grammar need not carry them)."""
    if not isinstance(schema, dict):
        return schema  # true or false
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _ANNOTATIONS:
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _rebased(v, i) for name, v in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [_rebased(v, i) for v in value]
        elif key in _SCHEMA_VALUES:
            out[key] = _rebased(value, i)
        else:
            out[key] = value  # data: enum, const, required, bounds
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        pointer = ref[1:]
        for key in ("/$defs/", "/definitions/"):
            if pointer.startswith(key):
                out["$ref"] = f"#/$defs/t{i}_{pointer[len(key) :]}"
                break
        else:
            out["$ref"] = f"#/$defs/t{i}{pointer}"
    return out
