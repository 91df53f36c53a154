"""What an OpenAI-compatible engine is sent: an allow-list of fields per provider type,
and the streaming switches.

Contract knowledge both sides need: the edge prepares a run's body for its provider's
type with it (``iop_edge.service.limits.RunBody``: the order then says
``body_prepared`` and the node posts the bytes as they came), and a node prepares the
body itself for an edge that does not (``iop_node.adapters.openai_compat``). Keys are
operation names (``chat_completions`` ...), the values of both services' ``Operation``.

A body reaches the engine with the fields OpenAI documents for its operation (the
API the edge speaks) and the engine's own fields its type lists here; any other
field is dropped before the request leaves the node. Engines read fields OpenAI
does not have, and some of them reach past what the edge bounds: llama.cpp's
``n_predict`` is an output length the edge's cap would not see, its ``id_slot``
pins another tenant's slot, vLLM's ``priority`` jumps its queue. The edge caps
the fields that multiply an answer's size, the engines' ones included
(``iop_edge.service.limits.ANSWER_SIZE_CAPS``), and its output-length table caps
every field in ``OUTPUT_LENGTH_FIELDS``; a field the edge does not know is only
safe on a list someone read.

Dropped, not refused: one model's providers may be of several types, and a
client cannot choose which one serves it. A field one engine understands and
another does not must not make the same request succeed or fail by where it was
routed; the engines themselves ignore fields they do not know (llama.cpp, vLLM
with a warning). An operator who needs another field adds it to its type's list.

The mock, Ollama and CLI adapters build what their engine gets from the fields
they read themselves; nothing else passes there either.

Streaming: only what streaming needs is forced (``stream``, and
``stream_options.include_usage`` where the type honours it, so usage is always counted;
the edge decides whether the client sees it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

OUTPUT_LENGTH_FIELDS: Final = ("max_tokens", "max_completion_tokens")
"""The output lengths passed to the engine (chat and completions): capped by the edge."""
ENGINE_OUTPUT_LENGTHS: Final = frozenset(
    {"n_predict", "num_predict", "max_new_tokens", "max_length", "max_output_tokens"}
)
"""Engines' own names for an output length: never on a list below (the edge caps the
OpenAI ones; these would pass it)."""

_CHAT: Final = frozenset(
    {
        "model",
        "messages",
        "audio",
        "frequency_penalty",
        "function_call",
        "functions",
        "logit_bias",
        "logprobs",
        "max_completion_tokens",
        "max_tokens",
        "metadata",
        "modalities",
        "n",
        "parallel_tool_calls",
        "prediction",
        "presence_penalty",
        "prompt_cache_key",
        "reasoning_effort",
        "response_format",
        "safety_identifier",
        "seed",
        "service_tier",
        "stop",
        "store",
        "stream",
        "stream_options",
        "temperature",
        "tool_choice",
        "tools",
        "top_logprobs",
        "top_p",
        "user",
        "verbosity",
        "web_search_options",
    }
)
_COMPLETIONS: Final = frozenset(
    {
        "model",
        "prompt",
        "best_of",
        "echo",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "max_tokens",
        "max_completion_tokens",  # not OpenAI's here, but capped by the edge like max_tokens
        "n",
        "presence_penalty",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "suffix",
        "temperature",
        "top_p",
        "user",
    }
)
_EMBEDDINGS: Final = frozenset({"model", "input", "dimensions", "encoding_format", "user"})
CHAT_COMPLETIONS: Final = "chat_completions"
COMPLETIONS: Final = "completions"
EMBEDDINGS: Final = "embeddings"
OPENAI_FIELDS: Final[Mapping[str, frozenset[str]]] = {
    CHAT_COMPLETIONS: _CHAT,
    COMPLETIONS: _COMPLETIONS,
    EMBEDDINGS: _EMBEDDINGS,
}
"""The request fields of OpenAI's API reference, per operation (2026)."""

_SAMPLING: Final = frozenset({"top_k", "min_p"})
_OWN_FIELDS: Final[Mapping[str, frozenset[str]]] = {
    # llama.cpp's server README (tools/server): sampling, constrained output, its cache,
    # probabilities (n_probs: capped by the edge as top_logprobs). Not n_predict (an
    # output length), id_slot (another request's slot), lora (the server's adapters).
    "llamacpp": _SAMPLING
    | {
        "typical_p",
        "repeat_penalty",
        "repeat_last_n",
        "dry_multiplier",
        "dry_base",
        "dry_allowed_length",
        "dry_penalty_last_n",
        "dry_sequence_breakers",
        "xtc_probability",
        "xtc_threshold",
        "top_n_sigma",
        "mirostat",
        "mirostat_tau",
        "mirostat_eta",
        "dynatemp_range",
        "dynatemp_exponent",
        "grammar",
        "json_schema",
        "ignore_eos",
        "n_probs",
        "post_sampling_probs",
        "samplers",
        "cache_prompt",
        "return_tokens",
        "timings_per_token",
        "chat_template_kwargs",
        "reasoning_format",
        "parse_tool_calls",
    },
    # vLLM's extra sampling and request parameters (prompt_logprobs: capped by the edge).
    # Not priority (its scheduler's order), request_id, kv_transfer_params, vllm_xargs,
    # use_beam_search (several sequences per choice) or logits_processors (code to run).
    "vllm": _SAMPLING
    | {
        "repetition_penalty",
        "length_penalty",
        "stop_token_ids",
        "include_stop_str_in_output",
        "ignore_eos",
        "min_tokens",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "truncate_prompt_tokens",
        "prompt_logprobs",
        "allowed_token_ids",
        "bad_words",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "guided_whitespace_pattern",
        "guided_decoding_backend",
        "structured_outputs",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "add_special_tokens",
        "documents",
        "echo",
        "return_tokens_as_token_ids",
    },
    # SGLang's sampling parameters. Not lora_path, rid or its disaggregation fields.
    "sglang": _SAMPLING
    | {
        "repetition_penalty",
        "min_tokens",
        "stop_token_ids",
        "no_stop_trim",
        "ignore_eos",
        "skip_special_tokens",
        "regex",
        "ebnf",
        "json_schema",
        "separate_reasoning",
        "stream_reasoning",
        "chat_template_kwargs",
        "continue_final_message",
    },
    "lemonade": _SAMPLING | {"repeat_penalty"},
    "openai_api": frozenset(),  # OpenAI itself: its own fields only
}
ENGINE_FIELDS: Final[Mapping[str, frozenset[str]]] = {
    **_OWN_FIELDS,
    # llama-swap hands a request to the llama.cpp server it started for the model
    "llamaswap": _OWN_FIELDS["llamacpp"],
}
"""Each OpenAI-compatible provider type's own fields that it is sent; its keys are the
OpenAI-compatible provider types."""
STREAM_USAGE: Final = frozenset(ENGINE_FIELDS)
"""The types whose servers honour ``stream_options.include_usage`` (all known ones do)."""
STREAM_FIELDS: Final = frozenset({"stream", "stream_options"})
"""The fields ``stream_switches`` writes (whatever the client put there)."""

ALLOWED: Final[Mapping[tuple[str, str], frozenset[str]]] = {
    (provider_type, operation): fields | own
    for provider_type, own in ENGINE_FIELDS.items()
    for operation, fields in OPENAI_FIELDS.items()
}
"""(OpenAI-compatible type, operation) -> the fields its requests keep (``allowed``)."""


def allowed(provider_type: str, operation: str) -> frozenset[str]:
    """The fields a request of ``operation`` keeps on its way to an engine of this type."""
    found = ALLOWED.get((provider_type, operation))
    return OPENAI_FIELDS[operation] if found is None else found


def stream_switches(
    body: Mapping[str, Any], provider_type: str, operation: str, stream: bool
) -> dict[str, Any]:
    """The streaming fields (``STREAM_FIELDS``) an engine of this type is sent for this
    run (none for embeddings): ``stream`` as the run streams, and the client's
    ``stream_options``, with ``include_usage`` on when streaming where the type honours it."""
    if operation == EMBEDDINGS:
        return {}
    if not stream or provider_type not in STREAM_USAGE:
        switches: dict[str, Any] = {"stream": stream}
        if "stream_options" in body:  # the client's, as it gave them
            switches["stream_options"] = body["stream_options"]
        return switches
    options = body.get("stream_options")
    merged = dict(options) if isinstance(options, dict) else {}
    merged["include_usage"] = True
    return {"stream": True, "stream_options": merged}


def provider_body(
    body: Mapping[str, Any], provider_type: str, operation: str, stream: bool
) -> dict[str, Any]:
    """What an engine of this type is sent: ``body`` (its ``model`` already the served
    name) less the fields the type is not sent, with the streaming switches (a new dict:
    the run's body is never changed)."""
    fields = allowed(provider_type, operation)
    payload = {name: value for name, value in body.items() if name in fields}
    payload.update(stream_switches(body, provider_type, operation, stream))
    return payload
