"""The fleet config from the control-plane as the edge's domain ``Fleet``."""

from __future__ import annotations

from iop_edge.adapters.fleet_proto import fleet_from_proto
from iop_edge.domain.fleet import (
    DEFAULT_MAX_OUTPUT_TOKENS,
    DEFAULT_RETRIES,
    NO_LIMITS,
    BudgetPeriod,
    KeyLimits,
)
from iop_proto.v1 import runtime_pb2 as pb


def test_a_models_output_cap_is_taken_and_defaults_when_unset() -> None:
    config = pb.FleetConfig(
        version=3,
        models=[
            pb.ModelConfig(id="capped", providers={"p": "s"}, max_output_tokens=4096),
            pb.ModelConfig(id="older-control-plane", providers={"p": "s"}),
        ],
    )
    models = fleet_from_proto(config).models
    assert models["capped"].max_output_tokens == 4096
    assert models["older-control-plane"].max_output_tokens == DEFAULT_MAX_OUTPUT_TOKENS == 32768


def test_a_models_retries_are_taken_zero_included_and_default_when_unset() -> None:
    config = pb.FleetConfig(
        models=[
            pb.ModelConfig(id="three", providers={"p": "s"}, retries=3),
            pb.ModelConfig(id="off", providers={"p": "s"}, retries=0),
            pb.ModelConfig(id="older-control-plane", providers={"p": "s"}),
        ],
    )
    models = fleet_from_proto(config).models
    assert [models[m].retries for m in ("three", "off")] == [3, 0]
    assert models["older-control-plane"].retries == DEFAULT_RETRIES == 2


def test_a_models_context_window_is_taken_and_zero_when_unset() -> None:
    config = pb.FleetConfig(
        models=[
            pb.ModelConfig(id="known", providers={"p": "s"}, context_window=8192),
            pb.ModelConfig(id="older-control-plane", providers={"p": "s"}),
        ],
    )
    models = fleet_from_proto(config).models
    assert [models[m].context_window for m in ("known", "older-control-plane")] == [8192, 0]


def test_a_keys_limits_weight_and_priority_are_taken_and_default_when_unset() -> None:
    config = pb.FleetConfig(
        api_keys=[
            pb.ApiKeyPolicy(
                key_id="a",
                key_hash="ha",
                limits=pb.KeyLimits(
                    requests_per_minute=5, token_budget=9, budget_period=pb.BUDGET_PERIOD_DAY
                ),
                model_limits=[pb.ModelKeyLimits(model="m", limits=pb.KeyLimits(max_concurrent=2))],
                weight=3,
                priority=-1,
            ),
            pb.ApiKeyPolicy(key_id="b", key_hash="hb", limits=pb.KeyLimits(token_budget=4)),
            pb.ApiKeyPolicy(key_id="c", key_hash="hc"),
        ]
    )
    keys = fleet_from_proto(config).api_keys
    assert keys["ha"].limits == KeyLimits(
        requests_per_minute=5, token_budget=9, budget_period=BudgetPeriod.DAY
    )
    assert keys["ha"].model_limits == {"m": KeyLimits(max_concurrent=2)}
    assert (keys["ha"].weight, keys["ha"].priority) == (3, -1)
    assert keys["hb"].limits.budget_period is BudgetPeriod.MONTH  # unset period: a month
    assert keys["hc"].limits == NO_LIMITS
    assert keys["hc"].limits.unlimited
    assert (keys["hc"].weight, keys["hc"].priority, keys["hc"].model_limits) == (1, 0, {})
