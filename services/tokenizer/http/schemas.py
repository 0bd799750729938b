"""The OpenAI request and response bodies tandem speaks, as pydantic models (the OpenAPI
document is made from them). Requests refuse a field they do not know; a field they know but
tandem does not support yet (tools, a JSON schema, images) is refused by name in convert.py.
Responses are written as plain dicts on the hot path (output.py): their models only document."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]
TokenIds = list[Annotated[int, Field(ge=0, le=2**31 - 1)]]
Count = Annotated[int, Field(ge=0, le=2**31 - 1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
Probability = Annotated[float, Field(ge=0, le=1)]
TokenIdText = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]
Bias = Annotated[float, Field(ge=-100, le=100)]
Role = Literal["system", "developer", "user", "assistant", "tool"]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    include_usage: bool | None = None  # a last chunk with the usage, before [DONE]
    continuous_usage_stats: bool | None = None  # vLLM's: every chunk carries the usage so far


class JsonSchema(BaseModel):
    name: str | None = None  # OpenAI requires it; tandem only documents it
    description: str | None = None
    # The output is held to the schema whatever `strict` says (guided decoding).
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None  # with type json_schema


class StructuredOutputs(_Request):
    """vLLM's extension for forms OpenAI has no field for; one of them."""

    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF
    json_: dict[str, Any] | str | None = Field(None, alias="json")  # a JSON Schema
    json_object: bool | None = None
    structural_tag: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")  # an image's or audio's fields: refused by type
    type: str  # only "text" is supported
    text: str | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Role  # developer is OpenAI's newer name for system
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call


class FunctionDefinition(BaseModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments
    strict: bool | None = None  # the arguments are held to `parameters` whatever it says


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class _Sampling(_Request):
    """What chat and completions requests share: sampling, stops, and tandem's extensions."""

    model: str | None = None  # the served model; None or "" takes it
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = None  # 0 or -1 (vLLM's): off
    min_p: Probability | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    bad_words: list[str] | None = None  # vLLM's: words the output may not contain
    n: Annotated[int, Field(ge=1, le=16)] | None = None  # sequences from each prompt
    logit_bias: dict[TokenIdText, Bias] | None = None  # token id (as a string) -> its bias
    allowed_token_ids: TokenIds | None = None  # vLLM's: only these may be sampled
    min_tokens: Count | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None  # vLLM's: false keeps special tokens' text
    priority: Int32 | None = None  # higher runs first (tandem's order; vLLM's is the reverse)
    session_id: str | None = None  # keeps a conversation's KV cached for its next turn
    user: str | None = None
    # OpenAI's, taken and needed by none: tandem has one service tier, its prefix cache keeps
    # every prompt's blocks whatever key they come with, and safety_identifier is as user.
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    best_of: Int32 | None = None  # refused above 1
    response_format: ResponseFormat | None = None  # text, json_object or json_schema
    structured_outputs: StructuredOutputs | None = None  # vLLM's forms
    # vLLM's older names of those forms (before structured_outputs), taken as them.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # taken: llguidance serves every form
    # vLLM's: score the prompt, each token with its rank and this many alternatives; answered
    # whole (not streamed) in `prompt_logprobs`.
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # vLLM's: the stop string that ended a choice stays at the end of its text.
    include_stop_str_in_output: bool | None = None
    # vLLM's: only the prompt's last this many tokens are run; -1: as many as fit.
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = None
    # vLLM's: each token in logprobs is "token_id:<id>" (what its text cannot always tell).
    return_tokens_as_token_ids: bool | None = None


class _Rendering(_Request):
    """vLLM's (and transformers') options of a chat's rendering."""

    add_generation_prompt: bool | None = None  # open the assistant's turn (default true)
    continue_final_message: bool | None = None  # the last message left open, to be continued
    chat_template_kwargs: dict[str, Any] | None = None  # more of the template's variables


class ChatCompletionRequest(_Sampling, _Rendering):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[Tool] | None = None
    # "auto" (OpenAI's default with tools), "required" or a named function: the output is held
    # to calls or text (tool_calls.py).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None  # refused when not empty
    function_call: str | dict[str, Any] | None = None  # refused unless "none"
    modalities: list[str] | None = None  # refused unless ["text"]
    audio: dict[str, Any] | None = None  # refused
    prediction: dict[str, Any] | None = None  # refused
    reasoning_effort: str | None = None  # refused
    echo: bool | None = None  # vLLM's: a last assistant message first in the reply's content


class CompletionRequest(_Sampling):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    # OpenAI's default; 0 only with echo: the prompt scored, nothing generated.
    max_tokens: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool | None = None  # the prompt first in each choice's text (and logprobs)
    suffix: str | None = None  # refused


class TokenizeRequest(_Rendering):  # vLLM's /tokenize: a prompt, or messages
    model: str | None = None
    prompt: str | None = None  # the ids a completion of it runs
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None  # a chat's
    tools: list[Tool] | None = None  # shown to a template that renders them, as in chat
    return_token_strs: bool | None = None  # each token's text beside its id


class DetokenizeRequest(_Request):  # vLLM's /detokenize
    model: str | None = None
    tokens: TokenIds


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None  # None when the reply is tool calls
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None  # a reasoning model's <think> part (reasoning.py)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str
    # vLLM's: the request's stop string or stop token id that ended the choice, else None.
    stop_reason: str | int | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # where asked for


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None for an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptTokenLogprob(BaseModel):
    logprob: float
    rank: int  # 1: the model's most likely token there
    decoded_token: str


# vLLM's form: None for the first token, then each token's id (as text) and its alternatives'.
PromptLogprobs = list[dict[str, PromptTokenLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str
    stop_reason: str | int | None = None  # as a chat choice's
    prompt_logprobs: PromptLogprobs | None = None  # where asked for


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(BaseModel):
    prompt: str
