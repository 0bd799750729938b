"""A reasoning model's reply split into its reasoning and its answer, as DeepSeek-R1 writes them:
"<think>" (or a generation prompt that ends with it), the reasoning, "</think>", the answer.
OpenAI-style clients read the answer in `content` and the reasoning in `reasoning_content`
(DeepSeek's API, vLLM's and llama.cpp's servers)."""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
FORMATS = ("auto", "none", "deepseek")


def reasons(format_: str, template: str) -> bool:
    """Whether replies are split: "deepseek", or "auto" with a chat template that writes
    <think> (DeepSeek-R1's distilled LLaMAs, Qwen3)."""
    if format_ not in FORMATS:
        raise ValueError(f"unknown reasoning format {format_!r}: one of {', '.join(FORMATS)}")
    return format_ == "deepseek" or (format_ == "auto" and OPEN in template)


class ReasoningSplit:
    """One reply's text, fed as it streams, split into (reasoning, content) deltas. Text that
    could be the start of a tag is held until the next text tells."""

    def __init__(self, opened: bool) -> None:
        """opened: the prompt ended inside <think> (its generation prompt wrote it)."""
        self._state = "reasoning" if opened else "start"
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        held = self._held + text
        self._held = ""
        if self._state == "start":
            stripped = held.lstrip()
            if stripped.startswith(OPEN):
                self._state, held = "reasoning", stripped[len(OPEN) :]
            elif OPEN.startswith(stripped):  # "", or the tag's beginning
                self._held = held
                return "", ""
            else:
                self._state = "content"
        if self._state == "reasoning":
            end = held.find(CLOSE)
            if end >= 0:
                self._state = "answer"
                return held[:end], self._answer(held[end + len(CLOSE) :])
            keep = _tag_start(held, CLOSE)
            self._held = held[len(held) - keep :] if keep else ""
            return held[: len(held) - keep], ""
        return "", self._answer(held) if self._state == "answer" else held

    def _answer(self, text: str) -> str:
        """Content after </think>, less the blank lines that begin it."""
        text = text.lstrip()
        if text:
            self._state = "content"
        return text

    def flush(self) -> tuple[str, str]:
        """What is held, once the reply has ended."""
        held, self._held = self._held, ""
        return (held, "") if self._state == "reasoning" else ("", held)


def _tag_start(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
