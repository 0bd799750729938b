"""How a model family writes tool calls: the grammar a reply of calls is held to, and how such a
reply is read back. Models are trained on their own form, and their chat templates show it in
the prompt; holding them to another form costs accuracy.

    json     LLaMA-3.x:  {"name": "f", "parameters": {...}}, or a list of them
    hermes   Hermes, Qwen: <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>, one
             after another on their own lines
    mistral  Mistral:    [TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]

A marker ("<tool_call>", "[TOOL_CALLS]") that is a special token of the vocabulary is held as
that token (its text alone would be other tokens, not the ones the model was trained on), and
the reply then keeps special tokens' text, or the marker could not be read back."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.guided import JSON_LAYOUT
from engine.tokenizer import Tokenizer

JSON, HERMES, MISTRAL = "json", "hermes", "mistral"
FORMATS = (JSON, HERMES, MISTRAL)
_REGEX_SPECIAL = set("\\.^$|?*+()[]{}/-")


@dataclass(frozen=True)
class ToolFormat:
    name: str  # one of FORMATS
    # Special token ids of the markers the vocabulary holds as one token; text otherwise.
    special: tuple[tuple[str, int], ...] = ()

    @classmethod
    def of(cls, tokenizer: Tokenizer, name: str = "auto") -> ToolFormat:
        """`name`, or with "auto" the form the chat template shows the model."""
        if name == "auto":
            template = tokenizer.chat_template
            name = detect(template.source if template is not None else "")
        if name not in FORMATS:
            known = ", ".join(FORMATS)
            raise ValueError(f"unknown tool call format {name!r}: one of auto, {known}")
        markers = {HERMES: ("<tool_call>", "</tool_call>"), MISTRAL: ("[TOOL_CALLS]",)}
        found = ((m, tokenizer.special_id(m)) for m in markers.get(name, ()))
        return cls(name, tuple((m, i) for m, i in found if i is not None))

    @property
    def arguments_key(self) -> str:
        return "parameters" if self.name == JSON else "arguments"

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether a reply must keep special tokens' text for its calls to be read."""
        return bool(self.special)

    def grammar(self, call: dict[str, Any], parallel: bool, auto: bool) -> str:
        """Lark for llguidance (hermes and mistral; json replies are held by a JSON Schema): a
        reply of calls, each held to `call` (a JSON Schema), one or, with `parallel`, more;
        with `auto`, or else text that does not begin as calls do."""
        body = f"call: %json {json.dumps({**call, 'x-guidance': JSON_LAYOUT})}\n"
        if self.name == HERMES:
            more = ' ("\\n" tagged)*' if parallel else ""
            body += f"calls: tagged{more}\n"
            body += f'tagged: {self._marker("<tool_call>")} "\\n" call "\\n" '
            body += f"{self._marker('</tool_call>')}\n"
            opening = "<tool_call>"
        else:
            more = ' (", " call)*' if parallel else ""
            body += f'calls: {self._marker("[TOOL_CALLS]")} " [" call{more} "]"\n'
            opening = "[TOOL_CALLS]"
        if not auto:
            return "start: calls\n" + body
        # Text may not begin with the marker's text either (as its special token, or spelled
        # out): a reply is read as calls by how it begins.
        return f"start: TEXT | calls\n{body}TEXT: /{not_beginning(opening)}/\n"

    def verdict(self, text: str) -> bool | None:
        """Whether a reply that begins with `text` is calls (True) or text (False); None while
        `text` could still be either (a marker's first characters)."""
        if not text:
            return None
        if self.name == JSON:
            return text[0] in "{["
        opening = "<tool_call>" if self.name == HERMES else "[TOOL_CALLS]"
        if text.startswith(opening):
            return True
        return None if opening.startswith(text) else False

    def write(self, calls: list[tuple[str, Any]]) -> str:
        """Calls (name, arguments) as the model writes them: an earlier turn's, shown again."""
        key = self.arguments_key
        objects = [{"name": name, key: arguments} for name, arguments in calls]
        if self.name == HERMES:
            return "\n".join(f"<tool_call>\n{_dumps(c)}\n</tool_call>" for c in objects)
        if self.name == MISTRAL:
            return f"[TOOL_CALLS] {_dumps(objects)}"
        return _dumps(objects if len(objects) > 1 else objects[0])

    def read(self, text: str) -> list[dict[str, str]] | None:
        """The calls (each {"name", "arguments"}, the arguments as JSON text) a whole reply
        holds; None where it holds none in this form."""
        try:
            if self.name == JSON:
                parsed = json.loads(text)
                found = parsed if isinstance(parsed, list) else [parsed]
            elif self.name == HERMES:
                parts = re.split(r"\s*</tool_call>\s*", text.strip())
                if parts[-1] or len(parts) < 2:
                    return None
                found = []
                for part in parts[:-1]:
                    if not part.startswith("<tool_call>"):
                        return None
                    found.append(json.loads(part.removeprefix("<tool_call>")))
            else:
                if not text.startswith("[TOOL_CALLS]"):
                    return None
                found = json.loads(text.removeprefix("[TOOL_CALLS]"))
                if not isinstance(found, list):
                    return None
            key = self.arguments_key
            return [
                {"name": c["name"], "arguments": json.dumps(c[key], ensure_ascii=False)}
                for c in found
            ]
        except (ValueError, TypeError, KeyError):
            return None

    def _marker(self, text: str) -> str:
        """A marker in Lark: its special token (by id), or its text."""
        for marker, token_id in self.special:
            if marker == text:
                return f"<[{token_id}]>"
        return json.dumps(text)


LLAMA_JSON = ToolFormat(JSON)


def detect(template: str) -> str:
    """The form a chat template's text shows the model (json where it shows neither marker)."""
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    return JSON


def not_beginning(prefix: str) -> str:
    """A regex of the texts (at least one character) that do not begin with `prefix`: those
    that leave it at some character, and its own proper beginnings."""
    alternatives: list[str] = []
    for k, ch in enumerate(prefix):
        head = _escaped(prefix[:k])
        alternatives.append(f"{head}[^{_escaped(ch)}][\\s\\S]*")
        if k:
            alternatives.append(head)
    return "(" + "|".join(alternatives) + ")"


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _escaped(text: Sequence[str]) -> str:
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)
