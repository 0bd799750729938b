"""What every tokenizer offers the engine and the services, whatever file it came from."""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from engine.errors import InvalidRequest
from engine.tokenizer.chat_template import ChatTemplate, Message

# Marks special-token text inside message content while the chat template renders it. A lone
# surrogate cannot come from input (`encode` refuses it), so the mark is never ambiguous.
_MARK = "\udfff"


def check_text(text: str, field: str) -> None:
    """Refuse text that cannot be UTF-8 (a lone surrogate): no tokenizer can encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidRequest(
            field, f"is not valid Unicode: {err.object[err.start]!r} at index {err.start}"
        ) from None


def with_tools(messages: Sequence[Message], tools: list[Any]) -> list[Message]:
    """`messages` with the tools and how to call them told in the system message (one is put
    first where there is none), the call in the form LLaMA 3.1's template asks for: for a chat
    template that has no place for tools, as TGI does."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    told = (
        f"You can call these functions:\n{listed}\n\nTo call one, reply with JSON alone, in the "
        'form {"name": function name, "parameters": dictionary of argument name and its value}.'
    )
    first = messages[0] if messages else None
    if (
        isinstance(first, dict)
        and first.get("role") == "system"
        and isinstance(first.get("content"), str)
    ):
        return [{**first, "content": f"{first['content']}\n\n{told}"}, *messages[1:]]
    return [{"role": "system", "content": told}, *messages]


@dataclass(kw_only=True, eq=False, repr=False)
class Tokenizer(ABC):
    """Text ↔ token ids for one model, plus the facts about its special tokens.

    Subclasses provide `encode`; everything else works from the table of the bytes each token
    stands for, so decoding and incremental detokenization agree by construction.
    """

    pieces: Sequence[bytes]  # the bytes each token id stands for
    special_ids: frozenset[int]
    bos_token_id: int | None
    # The ids that end generation (end of text, end of turn, ...).
    eos_token_ids: frozenset[int]
    # Whether a plain prompt should start with the BOS token (chat templates write it).
    add_bos: bool
    chat_template: ChatTemplate | None
    # bos_token / eos_token / ... as the chat template sees them.
    special_token_text: dict[str, str]
    # SentencePiece-style vocabularies mark a word start with a space that decoding drops
    # from the first token of a text.
    strips_leading_space: bool = False

    @abstractmethod
    def _encode(self, text: str, *, allow_special: bool) -> list[int]:
        """`encode` for text already known to be valid Unicode."""

    def encode(self, text: str, *, allow_special: bool, field: str = "text") -> list[int]:
        """Ids of `text`, never adding BOS. With `allow_special`, special-token text such as
        `<|eot_id|>` becomes that token; without, it is tokenized as the characters it is.
        Text that is not valid Unicode is an InvalidRequest naming `field`."""
        check_text(text, field)
        return self._encode(text, allow_special=allow_special)

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    def encode_prompt(self, text: str, *, allow_special: bool, field: str = "text") -> list[int]:
        """`encode`, with BOS in front when the model wants one and the text did not bring it."""
        ids = self.encode(text, allow_special=allow_special, field=field)
        bos = self.bos_token_id
        if self.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < len(self.pieces):
            raise InvalidRequest(
                "token_ids", f"{token_id} is outside the vocabulary (0..{len(self.pieces) - 1})"
            )
        return self.pieces[token_id]

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids

    def special_id(self, text: str) -> int | None:
        """The special token whose text is `text` (e.g. "<tool_call>"), if the vocabulary has
        one."""
        return self._special_by_text.get(text)

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        kept = [i for i in ids if not (skip_special and i in self.special_ids)]
        data = b"".join(self.token_bytes(i) for i in kept)
        if self.strips_leading_space and data.startswith(b" "):
            data = data[1:]
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        if self.chat_template is None:
            raise InvalidRequest("messages", "this model has no chat template")
        return self.chat_template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_token_text,
            **extra,
        )

    def encode_chat(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: list[Any] | None = None,
        *,
        continue_final_message: bool = False,
        variables: Mapping[str, Any] | None = None,
        **extra: Any,
    ) -> list[int]:
        """The ids of the rendered chat, where only the template's own markup becomes control
        tokens: special-token text inside a message is encoded as the characters it is, as in
        Meta's reference, so no message can close its turn or forge another role's. `tools`
        (OpenAI's form) go to a template that renders them, their text kept text the same way;
        a template with no place for them (the default model's) sees them in the system
        message (`with_tools`). `continue_final_message` leaves the last message open for the
        model to continue (a reply begun by the client); `variables` are more of the template's
        (e.g. {"enable_thinking": False}), their text kept text too."""
        template = self.chat_template
        if template is not None and not template.renders_tool_calls:
            for i, message in enumerate(messages):
                if isinstance(message, dict) and message.get("tool_calls"):
                    raise InvalidRequest(
                        f"messages[{i}].tool_calls",
                        "this model's chat template does not show earlier tool calls: write "
                        "them into the message's content",
                    )
        if tools is not None and template is not None and "tools" not in template.variables:
            messages, tools = with_tools(messages, tools), None
        marked = [self._mark_message(i, m) for i, m in enumerate(messages)]
        if tools is not None:
            extra["tools"] = self._mark_tree(tools, "tools")
        if variables:
            own = {"messages", "tools", "add_generation_prompt", *self.special_token_text}
            if clash := sorted(own.intersection(variables)):
                said = ", ".join(clash)
                raise InvalidRequest("chat_template_kwargs", f"{said}: set by tandem, not here")
            extra.update(self._mark_tree(dict(variables), "chat_template_kwargs"))
        if continue_final_message and add_generation_prompt:
            raise InvalidRequest(
                "continue_final_message",
                "cannot be used with add_generation_prompt (which opens a new turn): set it false",
            )
        text = self.apply_chat_template(marked, add_generation_prompt, **extra)
        if continue_final_message:
            text = _opened(text, marked, len(messages) - 1)
        # Special tokens split text before BPE runs, so encoding the pieces between the
        # template's specials gives the ids of the whole text when no content held one.
        ids: list[int] = []
        start = 0
        for match in self._special_pattern.finditer(text):
            ids += self._encode(text[start : match.start()].replace(_MARK, ""), allow_special=False)
            ids.append(self._special_by_text[match[0]])
            start = match.end()
        ids += self._encode(text[start:].replace(_MARK, ""), allow_special=False)
        return ids

    @cached_property
    def _special_by_text(self) -> dict[str, int]:
        return {self.pieces[i].decode("utf-8", "replace"): i for i in self.special_ids}

    @cached_property
    def _special_pattern(self) -> re.Pattern[str]:
        texts = sorted((t for t in self._special_by_text if t), key=len, reverse=True)
        return re.compile("|".join(map(re.escape, texts)) or "(?!)")

    def _mark_text(self, text: str, field: str) -> str:
        """`text` with a mark inside each special-token text, which encode_chat takes out after
        the template has matched its own markup."""
        check_text(text, field)
        return self._special_pattern.sub(lambda m: m[0][0] + _MARK + m[0][1:], text)

    def _mark_tree(self, value: Any, field: str) -> Any:
        """Every string in `value` (keys too) with its special-token text marked."""
        if isinstance(value, str):
            return self._mark_text(value, field)
        if isinstance(value, dict):
            return {self._mark_tree(k, field): self._mark_tree(v, field) for k, v in value.items()}
        if isinstance(value, list):
            return [self._mark_tree(v, field) for v in value]
        return value

    def _mark_message(self, index: int, message: Message) -> Message:
        if not isinstance(message, dict):
            return message  # the template's validation names it

        def mark(text: Any, field: str) -> Any:
            return self._mark_text(text, field) if isinstance(text, str) else text

        out: Message = {}
        for key, value in message.items():
            field = f"messages[{index}].{key}"
            if key == "tool_calls":  # names and arguments, which the template writes as JSON
                out[key] = self._mark_tree(value, field)
                continue
            if isinstance(value, list):
                value = [
                    {**p, "text": mark(p["text"], f"{field}[{j}].text")}
                    if isinstance(p, dict) and "text" in p
                    else p
                    for j, p in enumerate(value)
                ]
            out[key] = mark(value, field)
        return out


def _opened(text: str, messages: Sequence[Message], last: int) -> str:
    """The rendered chat cut after the last message's content, as transformers'
    continue_final_message cuts it: what the template writes after it (the end of its turn)
    goes, so the model goes on with the message."""
    content = messages[last].get("content") if isinstance(messages[last], dict) else None
    field = f"messages[{last}].content"
    if not isinstance(content, str):
        raise InvalidRequest(field, "must be text to be continued (continue_final_message)")
    if not content.strip():
        raise InvalidRequest(field, "is empty: continue_final_message has nothing to continue")
    for said in (content, content.strip()):  # a template may strip it
        if (at := text.rfind(said)) >= 0:
            return text[: at + len(said)]
    raise InvalidRequest(
        "continue_final_message",
        "the chat template does not write the last message's content as given, so it cannot "
        "be continued",
    )
