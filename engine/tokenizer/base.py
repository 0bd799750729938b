"""What every tokenizer offers the engine and the services, whatever file it came from."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from engine.errors import InvalidRequest
from engine.tokenizer.chat_template import ChatTemplate, Message


class Tokenizer(ABC):
    """Text ↔ token ids for one model, plus the facts about its special tokens.

    Subclasses provide `encode`; everything else works from the table of the bytes each token
    stands for, so decoding and incremental detokenization agree by construction.
    """

    def __init__(
        self,
        *,
        pieces: Sequence[bytes],
        special_ids: frozenset[int],
        bos_token_id: int | None,
        eos_token_ids: frozenset[int],
        add_bos: bool,
        chat_template: ChatTemplate | None,
        special_token_text: dict[str, str],
        strips_leading_space: bool = False,
    ) -> None:
        self._pieces = pieces
        self._special_ids = special_ids
        self.bos_token_id = bos_token_id
        # The ids that end generation (end of text, end of turn, ...).
        self.eos_token_ids = eos_token_ids
        # Whether a plain prompt should start with the BOS token (chat templates write it).
        self.add_bos = add_bos
        self.chat_template = chat_template
        # bos_token / eos_token / ... as the chat template sees them.
        self.special_token_text = special_token_text
        # SentencePiece-style vocabularies mark a word start with a space that decoding drops
        # from the first token of a text.
        self.strips_leading_space = strips_leading_space

    @abstractmethod
    def encode(self, text: str, *, allow_special: bool) -> list[int]:
        """Ids of `text`, never adding BOS. With `allow_special`, special-token text such as
        `<|eot_id|>` becomes that token; without, it is tokenized as the characters it is."""

    @property
    def vocab_size(self) -> int:
        return len(self._pieces)

    def encode_prompt(self, text: str, *, allow_special: bool) -> list[int]:
        """`encode`, with BOS in front when the model wants one and the text did not bring it."""
        ids = self.encode(text, allow_special=allow_special)
        bos = self.bos_token_id
        if self.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < len(self._pieces):
            raise InvalidRequest(
                "token_ids", f"{token_id} is outside the vocabulary (0..{len(self._pieces) - 1})"
            )
        return self._pieces[token_id]

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        kept = [i for i in ids if not (skip_special and i in self._special_ids)]
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
