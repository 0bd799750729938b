"""A model's chat template: jinja2 in a sandbox, rendered the way transformers renders it."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import meta, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import InvalidRequest, ModelFormatError

Message = dict[str, Any]


class _GenerationTag(Extension):
    # transformers marks assistant text with {% generation %}...{% endgeneration %} to build
    # training masks; for inference the block renders its body unchanged.
    tags = {"generation"}  # noqa: RUF012 (jinja2 reads this class attribute)

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson escapes HTML characters, which changes what the model is shown.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def validate_messages(messages: Sequence[Message]) -> None:
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise InvalidRequest("messages", "must be a non-empty list of {role, content} objects")
    for i, message in enumerate(messages):
        field = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequest(field, "must be an object with 'role' and 'content'")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequest(f"{field}.role", "missing, or not a non-empty string")
        if "content" not in message:
            raise InvalidRequest(f"{field}.content", "missing")
        content = message["content"]
        if content is None and message.get("tool_calls"):
            continue  # an assistant's turn of calls alone, as OpenAI's API gives it
        parts_ok = isinstance(content, list) and all(isinstance(p, dict) for p in content)
        if not isinstance(content, str) and not parts_ok:
            raise InvalidRequest(f"{field}.content", "must be a string or a list of parts")


class ChatTemplate:
    def __init__(self, source: str, *, now: Callable[[], datetime] = datetime.now) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: now().strftime(fmt)
        self.source = source
        try:
            self._template = env.from_string(source)
            # What the template reads besides messages: whether it has a place for tools.
            self.variables = frozenset(meta.find_undeclared_variables(env.parse(source)))
            # Whether it shows an assistant's earlier tool calls itself, in its model's form
            # (LLaMA 3.1's, Hermes', Mistral's do; a plain ChatML template ignores them).
            self.renders_tool_calls = "tool_calls" in source
        except jinja2.TemplateSyntaxError as err:
            raise ModelFormatError(
                f"the chat template does not compile: {err.message} (line {err.lineno})"
            ) from err

    def render(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool,
        special_tokens: dict[str, str],
        **extra: Any,
    ) -> str:
        validate_messages(messages)
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                **special_tokens,
                **extra,
            )
        except jinja2.TemplateError as err:
            # raise_exception() messages are written by the template's author for users.
            raise InvalidRequest("messages", f"rejected by the chat template: {err}") from err
        except Exception as err:
            # Anything else is a template tripping over unexpected input; its text may expose
            # internals, so name only its kind.
            raise InvalidRequest(
                "messages", f"the chat template failed on these messages ({type(err).__name__})"
            ) from err


def load_chat_template(given: str) -> ChatTemplate:
    """A chat template given on the command line: a file's path, or the Jinja text itself (as
    vLLM's --chat-template takes it). A value with no Jinja markup that names no file is an
    error that says so, not a template that renders that text."""
    path = Path(given).expanduser()
    if path.is_file():
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ModelFormatError(f"cannot read the chat template {path}: {err}") from err
        return ChatTemplate(source)
    if "{{" in given or "{%" in given:
        return ChatTemplate(given)
    raise ModelFormatError(
        f"chat template {given!r}: no such file, and no Jinja markup ({{{{ ... }}}} or "
        "{% ... %}) to read it as a template"
    )
