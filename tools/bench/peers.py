"""Other gateways measured in the same run: LiteLLM's proxy, from its own venv.

LiteLLM is installed by ``make bench-peers`` into ``tools/bench/.peers/litellm`` (its
dependency tree must not touch IOP's). Without that venv the benchmark still runs
and says "skipped" in LiteLLM's column.

Configured like IOP in the benchmark: one worker, no authentication (IOP runs
with no API keys), no per-request access log (IOP's edge writes none), a model
routed to the same fake backend through its ``openai/`` provider.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import aiohttp
import yaml

from iop_proto.testing import port_taken, ports_to_try

from .procs import Gateway, spawn

PEERS_DIR: Final = Path(__file__).resolve().parent / ".peers"
LITELLM_BIN: Final = PEERS_DIR / "litellm" / "bin" / "litellm"
LITELLM_READY_TIMEOUT_S: Final = 120.0  # it imports for ~30 s on 2 cores
SKIPPED: Final = "skipped (run make bench-peers)"

_QUIET_LOGS: Final = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(levelname)s %(name)s: %(message)s"}},
    "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {
        "uvicorn": {"handlers": ["stderr"], "level": "INFO"},
        "uvicorn.error": {"level": "INFO"},
        "uvicorn.access": {"handlers": ["stderr"], "level": "WARNING", "propagate": False},
    },
}


def litellm_available() -> bool:
    return LITELLM_BIN.is_file()


def litellm_version() -> str | None:
    """The installed version, from the venv's metadata (no import of the package)."""
    found = sorted(PEERS_DIR.glob("litellm/lib/python*/site-packages/litellm-*.dist-info"))
    if not found:
        return None
    return found[-1].name.removeprefix("litellm-").removesuffix(".dist-info")


@dataclass
class LiteLLM:
    base_url: str  # ends in /v1
    pid: int

    def gateway(self) -> Gateway:
        return Gateway("litellm", {"litellm": self.pid})


async def _wait_alive(url: str, timeout_s: float) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        async with asyncio.timeout(timeout_s):
            while True:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with http.get(f"{url}/health/liveliness") as response:
                        if response.status == 200:
                            return
                await asyncio.sleep(0.2)


def _write_config(root: Path, backend_url: str, models: Sequence[str]) -> tuple[Path, Path]:
    """The proxy's config (``models`` -> the fake backend) and its logging config."""
    root.mkdir(parents=True, exist_ok=True)
    config = {
        "model_list": [
            {
                "model_name": model,
                "litellm_params": {
                    "model": f"openai/{model}",
                    "api_base": f"{backend_url}/v1",
                    "api_key": "sk-fake",
                },
            }
            for model in models
        ],
        "general_settings": {"dangerously_permit_weak_or_unset_master_key": True},
        "litellm_settings": {"set_verbose": False},
    }
    config_file = root / "litellm.yaml"
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    log_config = root / "litellm-logging.json"
    log_config.write_text(json.dumps(_QUIET_LOGS))
    return config_file, log_config


@contextlib.asynccontextmanager
async def start_litellm(
    root: Path, backend_url: str, models: Sequence[str]
) -> AsyncIterator[LiteLLM]:
    """LiteLLM's proxy routing each of ``models`` to the fake backend, ready to serve."""
    config_file, log_config = _write_config(root, backend_url, models)
    env = {
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no download of the price list at start
        "LITELLM_LOG": "ERROR",
        "LITELLM_TELEMETRY": "False",
    }
    async with contextlib.AsyncExitStack() as stack:
        # LiteLLM cannot be told to bind port 0 and report it: give it one, again if taken.
        for port in ports_to_try():
            argv = [
                str(LITELLM_BIN),
                *("--config", str(config_file), "--host", "127.0.0.1", "--port", str(port)),
                *("--num_workers", "1", "--log_config", str(log_config)),
            ]
            attempt = contextlib.AsyncExitStack()
            url = f"http://127.0.0.1:{port}"
            try:
                child = await attempt.enter_async_context(
                    spawn(
                        argv,
                        ready=re.compile(r"Uvicorn running on|Application startup complete"),
                        log=root / "litellm.log",
                        timeout_s=LITELLM_READY_TIMEOUT_S,
                        env=env,
                    )
                )
                await _wait_alive(url, 30)
            except BaseException as exc:
                await attempt.aclose()  # whatever failed, the process it started goes
                if isinstance(exc, RuntimeError | TimeoutError) and port_taken(port):
                    continue  # another process bound the port first
                raise
            stack.push_async_callback(attempt.aclose)
            break
        yield LiteLLM(base_url=f"{url}/v1", pid=child.pid)
