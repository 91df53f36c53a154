"""A provider's "the prompt is past the model's context", told apart from other refusals.

Each engine says it its own way; the node makes every one ``ContextLengthExceeded``
(``ERROR_CODE_CONTEXT_LENGTH_EXCEEDED``, with the numbers where the engine gave them),
so that the edge answers OpenAI's ``context_length_exceeded`` (or Anthropic's "prompt
is too long"), which agents act on by compacting the conversation, and never retries
it on another provider. Recognised:

- llama.cpp's server: HTTP 400, ``{"error": {"type": "exceed_context_size_error",
  "n_prompt_tokens": M, "n_ctx": N, ...}}`` (``n_ctx``: the slot's context);
- vLLM: HTTP 400, "This model's maximum context length is N tokens. However, you
  requested T tokens (M in the messages, C in the completion)..." or "...your request
  has M input tokens..."; vLLM 0.32 checks the output asked first: "max_tokens=T cannot
  be greater than max_model_len=N. Please request fewer output tokens." (no prompt count);
- SGLang: "The input (M tokens) is longer than the model's context length (N tokens).";
- OpenAI itself (and servers that copy it): ``code: "context_length_exceeded"``;
- Ollama, with ``truncate`` off: "the input length exceeds the context length" (no numbers;
  by default Ollama truncates the prompt instead, and the run succeeds).
"""

from __future__ import annotations

import re
from typing import Any, Final

from iop_node.errors import ContextLengthExceeded

LLAMACPP_TYPE: Final = "exceed_context_size_error"
OPENAI_CODE: Final = "context_length_exceeded"
_WINDOW: Final = re.compile(r"maximum context length is (\d+) tokens")
_PROMPT: Final = re.compile(r"(\d+) in the messages|has (\d+) input tokens|in (\d+) tokens")
_SGLANG: Final = re.compile(
    r"input \((\d+) tokens\) is longer than the model's context length \((\d+) tokens\)"
)
_OUTPUT_PAST_WINDOW: Final = re.compile(r"cannot be greater than max_model_len=(\d+)")
_NUMBERLESS: Final = ("input length exceeds the context length", "exceeds the context window")


def context_overflow(
    error: Any, message: str, provider_status: int
) -> ContextLengthExceeded | None:
    """The failure when ``error`` (the provider's error object, or None) and its
    ``message`` say the prompt does not fit the model's context; None otherwise."""
    if isinstance(error, dict):
        if error.get("type") == LLAMACPP_TYPE:
            return ContextLengthExceeded(
                message,
                provider_status=provider_status,
                context_window=_count(error.get("n_ctx")),
                prompt_tokens=_count(error.get("n_prompt_tokens")),
            )
        if error.get("code") == OPENAI_CODE:
            return _from_text(message, provider_status) or ContextLengthExceeded(
                message, provider_status=provider_status
            )
    return _from_text(message, provider_status)


def _from_text(message: str, provider_status: int) -> ContextLengthExceeded | None:
    if (sglang := _SGLANG.search(message)) is not None:
        prompt, window = sglang.groups()
        return ContextLengthExceeded(
            message,
            provider_status=provider_status,
            context_window=int(window),
            prompt_tokens=int(prompt),
        )
    if (window_match := _WINDOW.search(message)) is not None:
        prompt_match = _PROMPT.search(message, window_match.end())
        prompt = next((int(g) for g in prompt_match.groups() if g), 0) if prompt_match else 0
        return ContextLengthExceeded(
            message,
            provider_status=provider_status,
            context_window=int(window_match.group(1)),
            prompt_tokens=prompt,
        )
    if (output_match := _OUTPUT_PAST_WINDOW.search(message)) is not None:
        return ContextLengthExceeded(
            message, provider_status=provider_status, context_window=int(output_match.group(1))
        )
    lowered = message.lower()
    if any(phrase in lowered for phrase in _NUMBERLESS):
        return ContextLengthExceeded(message, provider_status=provider_status)
    return None


def _count(value: Any) -> int:
    """A token count from the provider's JSON: a non-negative int below 2**32, else 0."""
    return value if type(value) is int and 0 <= value < 2**32 else 0
