"""Settings: a YAML file plus ``IOP_*`` environment overrides, validated once by pydantic.

dynaconf merges the file and the environment (``IOP_ADMIN__PORT=9100`` sets
``admin.port``); pydantic turns the merged mapping into a frozen model. A bad
value fails before anything starts, with the field and the file named.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Self, TypeVar

from dynaconf import Dynaconf
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from iop_proto.errors import SettingsError
from iop_proto.tls import TlsSettings

ENV_PREFIX = "IOP"


class FrozenModel(BaseModel):
    """Base of every settings model: immutable, and unknown keys are mistakes."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class AdminSettings(FrozenModel):
    """The admin HTTP port: ``/healthz`` and ``/metrics``."""

    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535, description="0 picks a free port")
    idle_timeout_s: float = Field(
        default=15.0,
        gt=0,
        description=(
            "a connection closes when it has not sent a whole request's headers this long after"
            " it opened or after its previous answer (idle keep-alive and slow headers alike)"
        ),
    )
    max_connections: int = Field(
        default=128,
        ge=1,
        description=(
            "connections held at once; at the cap the port stops accepting until one closes"
            " (new ones wait in the kernel's backlog)"
        ),
    )


class LogSettings(FrozenModel):
    level: Literal["TRACE", "DEBUG", "INFO", "SUCCESS", "WARNING", "ERROR", "CRITICAL"] = "INFO"
    json_format: bool = Field(default=False, alias="json")


class ServiceSettings(FrozenModel):
    """What every service has; each service's settings model extends it."""

    service_id: str = Field(min_length=1)
    admin: AdminSettings = AdminSettings()
    log: LogSettings = LogSettings()
    shutdown_timeout_s: float = Field(default=10.0, gt=0)
    tls: TlsSettings = Field(description="every IOP link is mutual TLS; see certs/README.md")
    event_loop: Literal["uvloop", "asyncio"] = Field(
        default="uvloop",
        description="uvloop (where installed: not on Windows) or asyncio's own loop, for debugging",
    )


class DrainingSettings(ServiceSettings):
    """A service that lets work in flight finish on SIGTERM (edge, node, worker): the drain
    gets ``shutdown_timeout_s`` minus ``shutdown_reserve_s``, closing the rest."""

    shutdown_reserve_s: float = Field(
        default=2.0,
        gt=0,
        description=(
            "of shutdown_timeout_s, what the drain leaves for the end: on SIGTERM work in"
            " flight gets shutdown_timeout_s minus this to finish, then links and stores close"
        ),
    )

    @model_validator(mode="after")
    def _reserve_fits(self) -> Self:
        if self.shutdown_reserve_s >= self.shutdown_timeout_s:
            raise ValueError(
                f"shutdown_reserve_s ({self.shutdown_reserve_s}) must be below"
                f" shutdown_timeout_s ({self.shutdown_timeout_s})"
            )
        return self

    @property
    def drain_s(self) -> float:
        """How long work in flight may go on finishing after SIGTERM."""
        return self.shutdown_timeout_s - self.shutdown_reserve_s


SettingsT = TypeVar("SettingsT", bound=BaseModel)


def _lower_keys(value: Any) -> Any:
    """dynaconf upper-cases keys; our models use lower-case field names."""
    if isinstance(value, dict):
        return {str(k).lower(): _lower_keys(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_lower_keys(v) for v in value]
    return value


def _describe(error: ValidationError, config_file: Path) -> str:
    lines = [f"invalid settings in {config_file} (or its {ENV_PREFIX}_* overrides):"]
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "(root)"
        env_name = f"{ENV_PREFIX}_" + "__".join(str(p).upper() for p in item["loc"])
        given = (
            f" (got {item['input']!r})"
            if "input" in item and not isinstance(item["input"], dict)
            else ""
        )
        lines.append(f"  {field}: {item['msg']}{given} [env: {env_name}]")
    return "\n".join(lines)


def load_settings(model: type[SettingsT], config_file: Path) -> SettingsT:
    """Read ``config_file`` and the environment into ``model``, or raise ``SettingsError``."""
    if not config_file.is_file():
        raise SettingsError(f"settings file {config_file} does not exist")
    raw = Dynaconf(settings_files=[str(config_file)], envvar_prefix=ENV_PREFIX)
    try:
        data = _lower_keys(raw.as_dict())
    except Exception as exc:
        # dynaconf raises its vendored YAML parser's errors (and OSError, and more): at
        # this boundary each is the same thing to the operator, a file that cannot be read.
        where = " ".join(str(exc).split())
        raise SettingsError(f"cannot read settings file {config_file}: {where}") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise SettingsError(_describe(exc, config_file)) from None
