"""How a model family writes tool calls: the grammar a reply of calls is held to, and how such a
reply is read back. Models are trained on their own form, and their chat templates show it in
the prompt; holding them to another form costs accuracy.

    json     LLaMA-3.x:  {"name": "f", "parameters": {...}}, or a list of them
    hermes   Hermes, Qwen: <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>, one
             after another on their own lines
    mistral  Mistral 7B v0.3, NeMo: [TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]
             (NeMo's without the space)
    mistral-args  Mistral Small 3.x, Devstral, Magistral, Ministral 3 (tokenizers v11 on):
             [TOOL_CALLS]f[ARGS]{...}, again for each call

A marker ("<tool_call>", "[TOOL_CALLS]", "[ARGS]") that is a special token of the vocabulary is
held as that token (its text alone would be other tokens, not the ones the model was trained
on), and the reply then keeps special tokens' text, or the marker could not be read back."""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.guided import JSON_LAYOUT
from engine.tokenizer import Tokenizer

JSON, HERMES, MISTRAL, MISTRAL_ARGS = "json", "hermes", "mistral", "mistral-args"
FORMATS = (JSON, HERMES, MISTRAL, MISTRAL_ARGS)
_MARKERS = {
    HERMES: ("<tool_call>", "</tool_call>"),
    MISTRAL: ("[TOOL_CALLS]",),
    MISTRAL_ARGS: ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
}
_CALL_ID = "[A-Za-z0-9]{9}"  # Mistral's ids, as its templates require them
_REGEX_SPECIAL = set("\\.^$|?*+()[]{}/-")
_ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ToolFormat:
    name: str  # one of FORMATS
    # Special token ids of the markers the vocabulary holds as one token; text otherwise.
    special: tuple[tuple[str, int], ...] = ()
    # Whether the chat template shows an assistant's earlier calls itself (message.tool_calls),
    # or they are written here, into the message's text.
    in_template: bool = False
    # mistral: what comes between [TOOL_CALLS] and the list ("[TOOL_CALLS] [" in Mistral 7B
    # v0.3's template, "[TOOL_CALLS][" in Mistral NeMo's).
    gap: str = " "
    # Whether the model writes each call's id itself, as its template shows earlier calls
    # (Mistral's: "id" last in each call's object; Small 3.2's: [CALL_ID]id before [ARGS]).
    writes_ids: bool = False

    @classmethod
    def of(cls, tokenizer: Tokenizer, name: str = "auto") -> ToolFormat:
        """`name`, or with "auto" the form the chat template shows the model."""
        template = tokenizer.chat_template
        source = template.source if template is not None else ""
        if name == "auto":
            name = detect(source)
        if name not in FORMATS:
            known = ", ".join(FORMATS)
            raise ValueError(f"unknown tool call format {name!r}: one of auto, {known}")
        found = ((m, tokenizer.special_id(m)) for m in _MARKERS.get(name, ()))
        return cls(
            name,
            tuple((m, i) for m, i in found if i is not None),
            in_template=template is not None and template.renders_tool_calls,
            gap="" if "[TOOL_CALLS][" in source else " ",
            writes_ids=(name == MISTRAL and '"id": "' in source)
            or (name == MISTRAL_ARGS and "[CALL_ID]" in source),
        )

    @property
    def arguments_key(self) -> str:
        return "parameters" if self.name == JSON else "arguments"

    @property
    def id_key(self) -> str | None:
        """The key of a call's own id in its JSON object, where the model writes one there."""
        return "id" if self.writes_ids and self.name == MISTRAL else None

    def call_id(self) -> str:
        """A new call's id, as the model's template takes it back (Mistral's: 9 letters and
        digits)."""
        if self.name in (MISTRAL, MISTRAL_ARGS):
            return "".join(secrets.choice(_ALNUM) for _ in range(9))
        return f"call_{secrets.token_hex(12)}"

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether a reply must keep special tokens' text for its calls to be read."""
        return bool(self.special)

    def grammar(self, call: dict[str, Any], parallel: bool, auto: bool) -> str:
        """Lark for llguidance (all but json, whose replies are held by a JSON Schema): a reply
        of calls, each held to `call` (a JSON Schema: _call_schema's, one of its calls), one
        or, with `parallel`, more; with `auto`, or else text that does not begin as calls do."""
        opening = "<tool_call>" if self.name == HERMES else "[TOOL_CALLS]"
        if self.name == MISTRAL_ARGS:
            body = self._named_calls(call) + f"calls: call{'+' if parallel else ''}\n"
        elif self.name == HERMES:
            more = ' ("\\n" tagged)*' if parallel else ""
            body = _json_rule("call", call) + f"calls: tagged{more}\n"
            body += f'tagged: {self._marker(opening)} "\\n" call "\\n" '
            body += f"{self._marker('</tool_call>')}\n"
        else:
            more = ' (", " call)*' if parallel else ""
            body = _json_rule("call", call)
            body += f'calls: {self._marker(opening)} "{self.gap}[" call{more} "]"\n'
        if not auto:
            return "start: calls\n" + body
        # Text may not begin with the marker's text either (as its special token, or spelled
        # out): a reply is read as calls by how it begins.
        return f"start: TEXT | calls\n{body}TEXT: /{not_beginning(opening)}/\n"

    def _named_calls(self, call: dict[str, Any]) -> str:
        """mistral-args' calls: the name is text before [ARGS], so each tool has a rule of its
        own, its name then its arguments."""
        defs, rules, names = call["$defs"], "", []
        for i, ref in enumerate(call["anyOf"]):
            one = defs[ref["$ref"].removeprefix("#/$defs/")]["properties"]
            name = json.dumps(one["name"]["const"])  # a Lark string: names are [A-Za-z0-9_-]
            rules += _json_rule(f"arguments{i}", {"$defs": defs, **one[self.arguments_key]})
            rules += f"call{i}: {self._marker('[TOOL_CALLS]')} {name} "
            if self.writes_ids:
                rules += f"{self._marker('[CALL_ID]')} CALL_ID "
            rules += f"{self._marker('[ARGS]')} arguments{i}\n"
            names.append(f"call{i}")
        rules += f"call: {' | '.join(names)}\n"
        return rules + (f"CALL_ID: /{_CALL_ID}/\n" if self.writes_ids else "")

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
            return f"[TOOL_CALLS]{self.gap}{_dumps(objects)}"
        if self.name == MISTRAL_ARGS:
            return "".join(f"[TOOL_CALLS]{name}[ARGS]{_dumps(a)}" for name, a in calls)
        return _dumps(objects if len(objects) > 1 else objects[0])

    def read(self, text: str) -> list[dict[str, str]] | None:
        """The calls (each {"name", "arguments"}, the arguments as JSON text, and "id" where the
        model writes it) a whole reply holds; None where it holds none in this form."""
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
            elif self.name == MISTRAL_ARGS:
                parts = text.split("[TOOL_CALLS]")
                if parts[0] or len(parts) < 2:
                    return None
                found = []
                for part in parts[1:]:
                    name, arguments = part.split("[ARGS]", 1)  # none: not calls (ValueError)
                    name, _, call_id = name.partition("[CALL_ID]")
                    call = {"name": name, "arguments": json.loads(arguments), "id": call_id}
                    found.append(call)
            else:
                if not text.startswith("[TOOL_CALLS]"):
                    return None
                found = json.loads(text.removeprefix("[TOOL_CALLS]"))
                if not isinstance(found, list):
                    return None
            key = self.arguments_key
            calls = []
            for c in found:
                call = {"name": c["name"], "arguments": json.dumps(c[key], ensure_ascii=False)}
                if self.writes_ids and c.get("id"):  # the model's own id, held to the form
                    call["id"] = c["id"]
                calls.append(call)
            return calls
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
    if "[ARGS]" in template:
        return MISTRAL_ARGS
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


def _json_rule(name: str, schema: dict[str, Any]) -> str:
    return f"{name}: %json {json.dumps({**schema, 'x-guidance': JSON_LAYOUT})}\n"


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _escaped(text: Sequence[str]) -> str:
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)
