"""Chat templates: SmolLM2's from its GGUF, LLaMA-3's format, and what bad input gets."""

from __future__ import annotations

import copy
from datetime import datetime
from typing import Any

import pytest

from engine.errors import InvalidRequest, ModelFormatError
from engine.tokenizer import ChatTemplate, Tokenizer

SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "What is the capital of Italy?"},
        {"role": "assistant", "content": "Rome."},
        {"role": "user", "content": "And of Spain? ½ 日本 😀"},
    ],
]


def test_smollm_adds_its_default_system_prompt(smollm: Tokenizer) -> None:
    text = smollm.apply_chat_template([{"role": "user", "content": "Hi!"}])
    assert text == (
        f"<|im_start|>system\n{SMOLLM_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_smollm_multi_turn_keeps_the_given_system_prompt(smollm: Tokenizer) -> None:
    text = smollm.apply_chat_template(CONVERSATIONS[1], add_generation_prompt=False)
    assert SMOLLM_SYSTEM not in text
    assert text == (
        "<|im_start|>system\nAnswer in French.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of Italy?<|im_end|>\n"
        "<|im_start|>assistant\nRome.<|im_end|>\n"
        "<|im_start|>user\nAnd of Spain? ½ 日本 😀<|im_end|>\n"
    )
    ids = smollm.encode(text, allow_special=True)
    assert ids.count(1) == 4 and ids.count(2) == 4  # <|im_start|>, <|im_end|>


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm_matches_transformers(
    smollm: Tokenizer, hf_smollm: Any, messages: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    expected = hf_smollm.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert smollm.apply_chat_template(messages, add_generation_prompt) == expected


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([], "messages"),
        ("hello", "messages"),
        (["hello"], "messages[0]"),
        ([{"content": "no role"}], "messages[0].role"),
        ([{"role": "user", "content": "ok"}, {"role": "user"}], "messages[1].content"),
        ([{"role": 3, "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 7}], "messages[0].content"),
    ],
)
def test_bad_messages_are_invalid_requests(
    smollm: Tokenizer, llama3: Tokenizer, messages: Any, field: str
) -> None:
    for tokenizer in (smollm, llama3):
        with pytest.raises(InvalidRequest) as caught:
            tokenizer.apply_chat_template(messages)
        assert caught.value.field == field


def render(source: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return ChatTemplate(source, **kwargs).render(
        messages, add_generation_prompt=True, special_tokens={"bos_token": "<s>"}
    )


USER = [{"role": "user", "content": "héllo <b>"}]


def test_raise_exception_becomes_an_invalid_request_naming_messages() -> None:
    source = (
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('need a system') }}{% endif %}"
    )
    with pytest.raises(InvalidRequest, match="need a system") as caught:
        render(source, USER)
    assert caught.value.field == "messages"


def test_template_runtime_errors_are_invalid_requests_without_internals() -> None:
    with pytest.raises(InvalidRequest, match=r"failed on these messages \(TypeError\)"):
        render("{{ messages[0]['content'] + 1 }}", USER)


def test_sandbox_refuses_python_internals() -> None:
    with pytest.raises(InvalidRequest, match="unsafe"):
        render("{{ messages.__class__.__mro__[1].__subclasses__() }}", USER)


def test_transformers_helpers_and_whitespace_control() -> None:
    source = (
        "{{ bos_token }}{{ messages | tojson }}\n"
        "{% for m in messages %}\n"
        "  [{{ m['role'] }}]\n"
        "{% endfor %}\n"
        "{{ strftime_now('%Y-%m-%d') }}"
        "{% generation %}!{% endgeneration %}"
    )
    text = render(source, USER, now=lambda: datetime(2026, 1, 2))
    # tojson keeps non-ASCII and HTML as is; trim_blocks/lstrip_blocks eat the tag lines.
    assert text == '<s>[{"role": "user", "content": "héllo <b>"}]\n  [user]\n2026-01-02!'


def test_a_template_that_does_not_compile_is_a_format_error() -> None:
    with pytest.raises(ModelFormatError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


def test_no_template_is_an_invalid_request(smollm: Tokenizer) -> None:
    import copy

    bare = copy.copy(smollm)
    bare.chat_template = None
    with pytest.raises(InvalidRequest, match="no chat template"):
        bare.apply_chat_template(USER)


PREFILLED = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "The colour I like best is"},
]


@pytest.mark.parametrize("messages", [PREFILLED, [*CONVERSATIONS[1], PREFILLED[1]]])
def test_a_continued_final_message_is_transformers(
    smollm: Tokenizer, hf_smollm: Any, messages: list[dict[str, Any]]
) -> None:
    """continue_final_message: the chat ends with the last message's content, open, as
    transformers renders it; the model goes on with the reply the client began."""
    expected = hf_smollm.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    ids = smollm.encode_chat(messages, False, continue_final_message=True)
    assert smollm.decode(ids) == expected and expected.endswith("is")
    assert ids == smollm.encode(expected, allow_special=True)


def test_a_final_message_that_cannot_be_continued_is_refused_naming_why(
    smollm: Tokenizer,
) -> None:
    with pytest.raises(InvalidRequest, match="continue_final_message: cannot be used with add_"):
        smollm.encode_chat(PREFILLED, True, continue_final_message=True)
    empty = [PREFILLED[0], {"role": "assistant", "content": " "}]
    with pytest.raises(InvalidRequest, match=r"messages\[1\].content: is empty"):
        smollm.encode_chat(empty, False, continue_final_message=True)
    dropping = ChatTemplate("{% for m in messages %}{{ m.role }}: ...\n{% endfor %}")
    tokenizer = copy.copy(smollm)
    tokenizer.chat_template = dropping
    with pytest.raises(InvalidRequest, match="does not write the last message's content"):
        tokenizer.encode_chat(PREFILLED, False, continue_final_message=True)


def test_template_variables_reach_the_template_as_text(smollm: Tokenizer) -> None:
    """chat_template_kwargs: more variables for the template (Qwen3's enable_thinking, say);
    their special-token text stays text, and the template's own variables are not theirs."""
    tokenizer = copy.copy(smollm)
    tokenizer.chat_template = ChatTemplate(
        "{% if not think %}<|im_start|>{% endif %}{{ note }}{{ messages[0].content }}"
    )
    chat = [{"role": "user", "content": "hi"}]
    assert tokenizer.decode(tokenizer.encode_chat(chat)) == "<|im_start|>hi"
    ids = tokenizer.encode_chat(chat, variables={"think": True, "note": "<|im_end|>"})
    assert tokenizer.decode(ids) == "<|im_end|>hi" and 2 not in ids  # text, not the token
    for own in ("messages", "bos_token", "add_generation_prompt"):
        with pytest.raises(InvalidRequest, match=f"chat_template_kwargs: {own}: set by tandem"):
            tokenizer.encode_chat(chat, variables={own: "x"})
