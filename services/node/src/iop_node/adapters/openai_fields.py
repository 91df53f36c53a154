"""Which request fields an OpenAI-compatible engine is sent: an allow-list per provider type.

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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from iop_node.domain.runs import Operation

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
OPENAI_FIELDS: Final[Mapping[Operation, frozenset[str]]] = {
    Operation.CHAT_COMPLETIONS: _CHAT,
    Operation.COMPLETIONS: _COMPLETIONS,
    Operation.EMBEDDINGS: _EMBEDDINGS,
}
"""The request fields of OpenAI's API reference, per operation (2026)."""

_SAMPLING: Final = frozenset({"top_k", "min_p"})
ENGINE_FIELDS: Final[Mapping[str, frozenset[str]]] = {
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
"""Each OpenAI-compatible provider type's own fields that it is sent."""


def allowed(provider_type: str, operation: Operation) -> frozenset[str]:
    """The fields a request of ``operation`` keeps on its way to an engine of this type."""
    return OPENAI_FIELDS[operation] | ENGINE_FIELDS.get(provider_type, frozenset())


def forwarded(fields: frozenset[str], body: Mapping[str, Any]) -> dict[str, Any]:
    """``body`` with only ``fields`` (a new dict: the run's body is never changed)."""
    return {name: value for name, value in body.items() if name in fields}
