"""A schema-driven fuzz of the HTTP API: requests that schemathesis draws from the served
OpenAPI document, valid and not, against a real `tandem serve` (the tiny random model). No
answer may be a 5xx, and the process must keep serving. Derandomized (conftest's Hypothesis
profile) with a bounded number of examples, so CI tests the same requests each run."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation.modes import GenerationMode

from harness.pipeline import Pipeline, pipeline

pytestmark = pytest.mark.slow

KEY = "fuzz-key"
EXAMPLES = {GenerationMode.POSITIVE: 40, GenerationMode.NEGATIVE: 25}
# Generation itself is not what is fuzzed: drawn requests generate a few tokens at most.
MAX_TOKENS = 4
MAX_N = 2
POSTS = {
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/tokenize",
    "/detokenize", "/v1/responses/input_tokens", "/v1/messages/count_tokens",
}  # fmt: skip
# Fields tandem refuses by name (tests/e2e/test_openai_api.py), and a model name that is not the
# served one: dropped from valid requests, so that more of them reach the admission path.
REFUSED = (
    "model", "tools", "functions", "tool_choice", "function_call", "response_format", "audio",
    "prediction", "reasoning_effort", "modalities", "best_of", "echo", "suffix", "store",
    "previous_response_id", "reasoning", "text", "thinking",
)  # fmt: skip


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    flags = ["--model", "llama3-tiny-random", "--api-key", KEY, "--max-num-seqs", "8"]
    with pipeline(tmp_path_factory.mktemp("fuzz"), *flags) as running:
        yield running


def _bounded(body: Any, mode: GenerationMode, path: str) -> Any:
    if not isinstance(body, dict):
        return body
    if mode == GenerationMode.POSITIVE:
        for name in REFUSED:
            body.pop(name, None)
        if path == "/detokenize" and isinstance(body.get("tokens"), list):
            body["tokens"] = [t % 256 for t in body["tokens"]]  # ids in the vocabulary
    if path == "/v1/messages":
        drawn = body.get("max_tokens")
        if isinstance(drawn, int) and drawn > MAX_TOKENS:
            body["max_tokens"] = MAX_TOKENS
        return body
    if path == "/v1/responses":
        drawn = body.get("max_output_tokens", MAX_TOKENS + 1)
        if isinstance(drawn, int) and drawn > MAX_TOKENS:
            body["max_output_tokens"] = MAX_TOKENS
        return body
    if not path.endswith("completions"):
        return body
    if mode == GenerationMode.POSITIVE:  # what would only be refused by name
        if not body.get("stream"):
            body.pop("stream_options", None)
        if body.get("top_logprobs") is not None:
            body["logprobs"] = True
    for name in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(name), int) and body[name] > MAX_TOKENS:
            body[name] = MAX_TOKENS
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_TOKENS
    if isinstance(body.get("n"), int) and body["n"] > MAX_N:
        body["n"] = MAX_N
    if isinstance(body.get("min_tokens"), int) and body["min_tokens"] > MAX_TOKENS:
        body["min_tokens"] = MAX_TOKENS
    return body


@pytest.mark.parametrize("mode", list(EXAMPLES))
def test_no_request_drawn_from_the_schema_is_a_server_error(
    served: Pipeline, mode: GenerationMode
) -> None:
    root = served.http_url.removesuffix("/v1")
    schema = schemathesis.openapi.from_url(f"{root}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= POSTS
    if mode == GenerationMode.NEGATIVE:  # a GET without parameters has no invalid form
        operations = [op for op in operations if op.method.upper() == "POST"]
    failures: list[str] = []
    served_ok: set[str] = set()
    for operation in operations:

        @settings(
            max_examples=EXAMPLES[mode],
            deadline=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(generation_mode=mode))
        def check(case: Any) -> None:
            case.body = _bounded(case.body, mode, case.path)
            response = case.call(
                base_url=root, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
            )
            if response.status_code == 200:
                served_ok.add(case.operation.path)
            if response.status_code >= 500:
                failures.append(
                    f"{case.method} {case.path} {case.body!r}: "
                    f"{response.status_code} {response.text[:300]}"
                )

        check()
    assert not failures, "\n".join(failures[:10])
    if mode == GenerationMode.POSITIVE:  # some drawn requests got past validation and generated
        assert served_ok >= POSTS
    assert served.proc.poll() is None, "tandem serve died"
    assert "Traceback" not in served.log(), served.log()[-3000:]
