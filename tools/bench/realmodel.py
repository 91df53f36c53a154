"""A real model: SmolLM2-135M on llama.cpp, tokens/s direct and through IOP.

The fake backend shows what the gateway costs; this shows whether that cost
matters next to real generation on the same 2 cores. Streams alternate direct /
IOP with the same prompt, ``max_tokens`` and ``ignore_eos`` (llama.cpp's own
parameter, passed through by IOP unchanged) so every stream generates exactly
the same number of tokens. tokens/s = completion tokens / the stream's whole
time (request sent to last byte); the decode rate between the first and last
token is kept in the JSON too.

The ratio is the median of each round's IOP/direct pair (two streams back to
back): on a shared 2-core machine the model's own speed drifts by +-10 % from
one minute to the next, which a ratio of means over the whole run would carry.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from .client import Target, session, stream
from .results import Row, ScenarioResult, ratio

SCENARIO = "realmodel"
CONTENT: bytes = b'"content":"'


@dataclass(frozen=True)
class Settings:
    rounds: int
    tokens: int


def skipped(reason: str) -> ScenarioResult:
    return ScenarioResult(SCENARIO, status="skipped", reason=reason)


EXTRA: dict[str, Any] = {
    "temperature": 0,
    "seed": 7,
    "ignore_eos": True,  # llama.cpp's and vLLM's own: every stream runs to max_tokens
    "stream_options": {"include_usage": True},
}


async def run(targets: dict[str, Target], settings: Settings) -> ScenarioResult:
    """``targets``: ``direct`` (the llama.cpp server) and ``iop``."""
    result = ScenarioResult(SCENARIO)
    rates, decode = await pairs(targets, settings)
    result.data, share = summarise(rates, decode, settings)
    mean = result.data["mean_tokens_per_s"]
    result.rows = [
        Row(SCENARIO, f"SmolLM2-135M tokens/s ({settings.tokens}-token streams)", "tokens/s",
            mean["iop"], mean["direct"], "not measured (no LiteLLM route)", share,
            "IOP/direct (median of pairs)", ">= 0.97x direct",
            None if share is None else share >= 0.97),
    ]  # fmt: skip
    return result


async def pairs(
    targets: dict[str, Target], settings: Settings
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each round one stream per target, back to back, alternating who goes first:
    (tokens/s of each stream, decode tokens/s of each stream) per target."""
    rates: dict[str, list[float]] = {name: [] for name in targets}
    decode: dict[str, list[float]] = {name: [] for name in targets}
    extra = EXTRA
    names = list(targets)
    async with session(len(names), keepalive=False) as http:
        for name in names:  # warm-up: load the prompt cache and the connections
            await stream(http, targets[name], 4, marker=CONTENT, expect=1, **extra)
        for i in range(settings.rounds):
            for name in names[i % 2 :] + names[: i % 2]:
                timing = await stream(
                    http, targets[name], settings.tokens, marker=CONTENT, expect=1, **extra
                )
                tokens = timing.usage_tokens or timing.content_chunks
                rates[name].append(tokens / timing.total_s)
                span = timing.arrivals[-1] - timing.arrivals[0] if timing.arrivals else 0.0
                if span > 0:
                    decode[name].append((len(timing.arrivals) - 1) / span)
    return rates, decode


def summarise(
    rates: dict[str, list[float]], decode: dict[str, list[float]], settings: object
) -> tuple[dict[str, Any], float | None]:
    """The JSON of a direct/IOP comparison, and its share (median of IOP/direct pairs)."""
    mean = {name: statistics.fmean(values) for name, values in rates.items()}
    ratios = [iop / direct for iop, direct in zip(rates["iop"], rates["direct"], strict=True)]
    share = statistics.median(ratios) if ratios else None
    data = {
        "tokens_per_s": rates,
        "decode_tokens_per_s": decode,
        "mean_tokens_per_s": mean,
        "pair_ratios": ratios,
        "ratio_of_means": ratio(mean["iop"], mean["direct"]),
        "settings": dict(settings.__dict__),
    }
    return data, share
