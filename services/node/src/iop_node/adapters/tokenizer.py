"""A chat body's prompt tokens from an OpenAI-compatible engine's own tokenizer.

The ``count_tokens`` operation (Anthropic's ``/v1/messages/count_tokens``) asks how
many tokens a prompt takes: only the engine knows (its chat template, its
tokenizer), and both engines here answer without generating, so without one of
the generation slots (the executor runs it outside the capacity gate):

- llama.cpp: ``POST /apply-template`` renders the chat body as
  ``/v1/chat/completions`` would (messages, tools, template options), then
  ``POST /tokenize`` counts that text as the completion does (special tokens added
  and parsed). Tested to equal a chat completion's ``prompt_tokens``.
- vLLM: ``POST /tokenize`` with the messages (and tools) applies the chat template
  itself and answers ``count`` (not run against a real vLLM here: no GPU in the tests
  that cover this module).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from iop_node.adapters.provider_http import ProviderHttp, ProviderHttpError
from iop_node.errors import InvalidRequest, ProviderFailed, ProviderUnavailable
from iop_proto import json_codec

LLAMACPP: Final = "llamacpp"
VLLM: Final = "vllm"
STYLES: Final = (LLAMACPP, VLLM)
VLLM_FIELDS: Final = ("model", "messages", "tools", "chat_template", "chat_template_kwargs")
"""What of a chat body vLLM's ``/tokenize`` reads (it warns about any other field)."""
CLIENT_FAULTS: Final = frozenset({400, 422})
NOT_FOUND: Final = 404
NOT_IMPLEMENTED: Final = 501
"""An engine without the endpoint (an older build): it does not offer the operation."""
ERROR_TAIL: Final = 500
CONNECT_TIMEOUT_S: Final = 10.0
"""The connect only: the run's deadline bounds the rest (the executor's)."""


async def prompt_tokens(
    style: str,
    http: ProviderHttp,
    base: str,
    headers: Mapping[str, str],
    body: Mapping[str, Any],
) -> int:
    """The prompt tokens of the chat ``body`` on the engine at ``base`` (``style``: one
    of ``STYLES``); ``RunFailure``s as a chat run's (404 and 501: the engine has no such
    endpoint, so it does not offer the operation)."""
    if style == LLAMACPP:
        template = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        rendered = await _post(http, base + "/apply-template", headers, template)
        prompt = rendered.get("prompt")
        if not isinstance(prompt, str):
            raise ProviderFailed(f"{base}/apply-template: no prompt in the answer")
        counted = await _post(
            http,
            base + "/tokenize",
            headers,
            {"content": prompt, "add_special": True, "parse_special": True},
        )
        tokens = counted.get("tokens")
        if not isinstance(tokens, list):
            raise ProviderFailed(f"{base}/tokenize: no tokens in the answer")
        return len(tokens)
    asked = {k: body[k] for k in VLLM_FIELDS if k in body}
    asked["add_generation_prompt"] = True  # what a chat completion's prompt ends with
    counted = await _post(http, base + "/tokenize", headers, asked)
    count = counted.get("count")
    if type(count) is not int:
        raise ProviderFailed(f"{base}/tokenize: no count in the answer")
    return count


async def _post(
    http: ProviderHttp,
    url: str,
    headers: Mapping[str, str],
    payload: Mapping[str, Any],
) -> dict[str, Any]:
    try:
        response = await http.request(
            "POST",
            url,
            body=json_codec.dumps(payload),
            headers=headers,
            connect_timeout_s=CONNECT_TIMEOUT_S,
        )
        async with response:
            raw = await response.read()
            status = response.status
    except ProviderHttpError as exc:
        raise ProviderUnavailable(f"{url}: {type(exc).__name__}: {exc}") from exc
    if status >= 400:
        message = f"{url}: HTTP {status}: {raw[:ERROR_TAIL].decode(errors='replace')}"
        if status in (NOT_FOUND, NOT_IMPLEMENTED):
            raise InvalidRequest(message, provider_status=NOT_IMPLEMENTED)
        if status in CLIENT_FAULTS:
            raise InvalidRequest(message, provider_status=status)
        raise ProviderFailed(message, provider_status=status)
    try:
        answer = json_codec.loads(raw)
    except ValueError:
        raise ProviderFailed(f"{url}: the answer is not JSON") from None
    if not isinstance(answer, dict):
        raise ProviderFailed(f"{url}: the answer is not a JSON object")
    return answer
