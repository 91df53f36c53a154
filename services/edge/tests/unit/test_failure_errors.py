"""``errors.from_failure``: the one mapping from a run's error to what the client sees.

A provider's own HTTP status travels with an invalid request (``provider_status``) and
picks the OpenAI error that says the same thing: 501 "does not offer this operation",
404 "no such model" (vLLM's answer for a served name it lacks), the rest a plain 400.
"""

from __future__ import annotations

import pytest

from iop_edge.domain.events import ErrorCode, Failed
from iop_edge.errors import (
    EdgeError,
    InvalidRequest,
    ModelNotFound,
    ProviderFailed,
    UnsupportedOperation,
    from_failure,
)


@pytest.mark.parametrize(
    ("provider_status", "kind", "status", "code"),
    [
        (0, InvalidRequest, 400, None),
        (400, InvalidRequest, 400, None),
        (422, InvalidRequest, 400, None),
        (404, ModelNotFound, 404, "model_not_found"),
        (501, UnsupportedOperation, 400, "unsupported_operation"),
    ],
)
def test_an_invalid_request_takes_the_providers_status_into_account(
    provider_status: int, kind: type[EdgeError], status: int, code: str | None
) -> None:
    message = "HTTP 404: The model `typo` does not exist."
    error = from_failure(Failed(ErrorCode.INVALID_REQUEST, message, provider_status))
    assert type(error) is kind
    assert error.status == status
    assert error.type == "invalid_request_error"
    assert error.code == code
    assert error.message == message  # the provider's own words reach the client


def test_a_404_names_the_model_parameter() -> None:
    error = from_failure(Failed(ErrorCode.INVALID_REQUEST, "no such model", 404))
    assert error.param == "model"


def test_a_provider_error_with_a_404_status_stays_a_provider_error() -> None:
    """Only an invalid request becomes model_not_found: a 404 inside a provider failure
    (a proxy's, mid-stream) is still the provider's failure."""
    error = from_failure(Failed(ErrorCode.PROVIDER_ERROR, "HTTP 404", 404))
    assert isinstance(error, ProviderFailed)
    assert error.status == 502
