"""The form a request holds its output to, as the gRPC API's one OutputFormat: OpenAI's
response_format, vLLM's structured_outputs, or vLLM's older guided_* fields (taken as those);
and the field an error in the form names."""

from __future__ import annotations

import json
from typing import Any

from engine.errors import InvalidRequest
from services.tokenizer.http.schemas import StructuredOutputs, _Sampling
from tandem.v1 import generation_pb2 as pb


def add_output_format(out: pb.OutputFormat, body: _Sampling) -> None:
    """response_format (OpenAI's) or structured_outputs (vLLM's) as the gRPC API's one format."""
    fmt, extra = body.response_format, body.structured_outputs
    given = "structured_outputs"
    if (legacy := _guided(body)) is not None:
        name, value = legacy
        if extra is not None:
            raise InvalidRequest(f"guided_{name}", "give it or structured_outputs, not both")
        extra, given = StructuredOutputs.model_validate({name: value}), f"guided_{name}"
    if fmt is not None and fmt.type != "text":
        if extra is not None:
            raise InvalidRequest(given, "give it or response_format, not both")
        if fmt.type == "json_object":
            out.json_object = True
        else:
            schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
            if schema is None:
                raise InvalidRequest("response_format.json_schema", "needs a schema")
            out.json_schema = json.dumps(schema)
    if extra is None:
        return
    if extra.structural_tag is not None:
        raise InvalidRequest("structured_outputs.structural_tag", "is not supported")
    forms = ("json_", "json_object", "regex", "choice", "grammar")
    if sum(getattr(extra, name) not in (None, False) for name in forms) != 1:
        raise InvalidRequest(
            "structured_outputs", "give one of json, json_object, regex, choice or grammar"
        )
    if extra.json_ is not None:
        as_given = extra.json_
        out.json_schema = as_given if isinstance(as_given, str) else json.dumps(as_given)
    elif extra.json_object:
        out.json_object = True
    elif extra.regex is not None:
        out.regex = extra.regex
    elif extra.grammar is not None:
        out.grammar = extra.grammar
    else:
        out.choice.choices.extend(extra.choice or ())


def format_param(body: _Sampling) -> str | None:
    """What an error in the output's form names where vLLM's fields gave it: the older
    guided_* field given, or structured_outputs.json (its other forms are named as they are)."""
    if (legacy := _guided(body)) is not None:
        return f"guided_{legacy[0]}"
    extra = body.structured_outputs
    return "structured_outputs.json" if extra is not None and extra.json_ is not None else None


_GUIDED = ("json", "regex", "choice", "grammar")


def _guided(body: _Sampling) -> tuple[str, Any] | None:
    """The form an older guided_* field gives (vLLM's names before structured_outputs)."""
    given = [(name, v) for name in _GUIDED if (v := getattr(body, f"guided_{name}")) is not None]
    if len(given) > 1:
        names = " and ".join(f"guided_{name}" for name, _ in given)
        raise InvalidRequest(f"guided_{given[1][0]}", f"give one form, not {names}")
    return given[0] if given else None
