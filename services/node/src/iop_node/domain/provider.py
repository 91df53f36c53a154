"""A provider's configuration as the node holds it (converted from ``pb.ProviderConfig``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class ProviderConfig:
    """One ``nodes[].providers[]`` entry of the fleet file, as the edge sent it.

    ``settings`` holds the type's own settings (``endpoint``, ``api_key_env``,
    ``command``, ``prompt_via``, ``tokens_per_second``, ``default_tokens`` ...).
    """

    id: str
    type: str
    category: str = "local_inference"
    models: tuple[str, ...] = ()
    capacity: int = 1
    max_queue: int = 16
    queue_timeout_ms: int = 30_000
    request_timeout_ms: int = 600_000
    settings: Mapping[str, Any] = field(default_factory=dict)
    control_state: str = ""  # an operator's "disabled" or "draining" (AdmissionGate.hold)

    def setting(self, key: str, default: Any = None) -> Any:
        value = self.settings.get(key)
        return default if value is None else value
