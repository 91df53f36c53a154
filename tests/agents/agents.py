"""The coding agents, each as a user sets it up: installed at a pinned version (``make
agents``: npm into ``var/agents``, aider from PyPI into ``var/agents/aider``) and
configured only through its documented settings (a config file in a fresh home folder
and environment variables), never with a flag that turns a failing feature off.

Each ``Agent`` knows where its binary is, how to point it at an IOP origin and model,
and the command that runs one non-interactive turn. The versions here are the ones
``make agents`` installs (the Makefile reads them from ``VERSIONS``).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
AGENTS_DIR = REPO / "var" / "agents"
NPM_BIN = AGENTS_DIR / "node_modules" / ".bin"
AIDER_BIN = AGENTS_DIR / "aider" / "bin" / "aider"
API_KEY = "iop-agents-test"  # the dev stack is open to loopback clients; agents insist on one

VERSIONS = {
    "@openai/codex": "0.171.0",
    "@anthropic-ai/claude-code": "2.1.197",
    "opencode-ai": "1.18.33",
    "@continuedev/cli": "1.5.47",
    "aider-chat": "0.86.2",
}


@dataclass(frozen=True)
class Turn:
    """One finished run of an agent."""

    returncode: int
    output: str
    seconds: float


@dataclass(frozen=True)
class Agent:
    """One agent: ``name`` (the test id), its binary, the API it speaks and the tool it is
    asked to use (``tool``: a name that appears in its request's tool list)."""

    name: str
    package: str  # its name in npm or PyPI, a key of VERSIONS
    binary: Path
    api: str  # "responses", "messages" or "chat"
    tool: str | None
    websocket: bool = False

    @property
    def version(self) -> str:
        return VERSIONS[self.package]

    def missing(self) -> str | None:
        """Why the agent cannot run here, or ``None``."""
        if not self.binary.exists():
            return f"{self.binary} is not installed (`make agents` installs it)"
        if shutil.which("node") is None and self.binary.parent == NPM_BIN:
            return "node is not installed"
        return None

    def prompt(self) -> str:
        if self.tool is None:
            return "Say hello in one short sentence."
        return f"Use the {self.tool} tool once to list this folder, then answer in one sentence."

    def configure(self, home: Path, origin: str, model: str) -> tuple[list[str], dict[str, str]]:
        """Write the agent's own settings under ``home``; the command and environment of
        one non-interactive turn against ``origin`` (no ``/v1``) with ``model``."""
        home.mkdir(parents=True, exist_ok=True)
        env = {
            "HOME": str(home),
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "NO_COLOR": "1",
            "TERM": "dumb",
            "LANG": "C.UTF-8",
        }
        builder = getattr(self, f"_{self.name.replace('-', '_')}")
        command, extra = builder(home, origin, model)
        return command, {**env, **extra}

    def _codex(self, home: Path, origin: str, model: str) -> tuple[list[str], dict[str, str]]:
        codex_home = home / ".codex"
        codex_home.mkdir(exist_ok=True)
        websockets = "supports_websockets = true\n" if self.websocket else ""
        (codex_home / "config.toml").write_text(
            f'model = "{model}"\n'
            'model_provider = "iop"\n'
            "[model_providers.iop]\n"
            'name = "IOP"\n'
            f'base_url = "{origin}/v1"\n'
            'env_key = "IOP_API_KEY"\n'
            'wire_api = "responses"\n'
            f"{websockets}"
            "[analytics]\nenabled = false\n"
            "[feedback]\nenabled = false\n"
        )
        command = [str(self.binary), "exec", "--skip-git-repo-check", self.prompt()]
        return command, {"CODEX_HOME": str(codex_home), "IOP_API_KEY": API_KEY}

    _codex_ws = _codex

    def _claude(self, home: Path, origin: str, model: str) -> tuple[list[str], dict[str, str]]:
        settings = home / ".claude" / "settings.json"
        settings.parent.mkdir(exist_ok=True)
        # The documented permission rule that lets `claude -p` run the one command it is
        # asked to run (a non-interactive session cannot ask).
        settings.write_text(json.dumps({"permissions": {"allow": ["Bash(ls:*)", "Bash(echo:*)"]}}))
        env = {
            "ANTHROPIC_BASE_URL": origin,
            "ANTHROPIC_API_KEY": API_KEY,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1",
        }
        return [str(self.binary), "-p", "--model", model, self.prompt()], env

    def _opencode(self, home: Path, origin: str, model: str) -> tuple[list[str], dict[str, str]]:
        config = home / ".config" / "opencode" / "opencode.json"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(
            json.dumps(
                {
                    "$schema": "https://opencode.ai/config.json",
                    "provider": {
                        "iop": {
                            "npm": "@ai-sdk/openai-compatible",
                            "name": "IOP",
                            "options": {"baseURL": f"{origin}/v1", "apiKey": API_KEY},
                            "models": {model: {"name": model}},
                        }
                    },
                }
            )
        )
        env = {
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_SHARE": "1",
            "OPENCODE_DISABLE_MODELS_FETCH": "1",
        }
        return [str(self.binary), "run", "-m", f"iop/{model}", self.prompt()], env

    def _continue(self, home: Path, origin: str, model: str) -> tuple[list[str], dict[str, str]]:
        config = home / "continue.yaml"
        config.write_text(
            "name: iop\nversion: 1.0.0\nschema: v1\nmodels:\n"
            f"  - name: {json.dumps(model)}\n    provider: openai\n    model: {json.dumps(model)}\n"
            f"    apiBase: {origin}/v1\n    apiKey: {API_KEY}\n    roles: [chat, edit, apply]\n"
        )
        env = {"CONTINUE_CLI_ENABLE_TELEMETRY": "0"}
        return [str(self.binary), "-p", "--config", str(config), self.prompt()], env

    def _aider(self, home: Path, origin: str, model: str) -> tuple[list[str], dict[str, str]]:
        env = {
            "OPENAI_API_BASE": f"{origin}/v1",
            "OPENAI_API_KEY": API_KEY,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        }
        command = [
            str(self.binary),
            "--model",
            f"openai/{model}",
            "--no-check-update",
            "--analytics-disable",
            "--no-show-model-warnings",
            "--yes-always",
            "--no-git",
            "--no-pretty",
            "--message",
            self.prompt(),
        ]
        return command, env

    async def run(
        self, home: Path, workdir: Path, origin: str, model: str, timeout_s: float
    ) -> Turn:
        """One turn, in ``workdir``, stdin closed; killed (with everything it started) after
        ``timeout_s``."""
        command, env = self.configure(home, origin, model)
        started = time.monotonic()
        process = await asyncio.create_subprocess_exec(
            *command,
            cwd=workdir,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            out, _ = await asyncio.wait_for(process.communicate(), timeout_s)
        except TimeoutError:
            os.killpg(process.pid, 9)
            out, _ = await process.communicate()
            return Turn(-9, out.decode(errors="replace"), time.monotonic() - started)
        seconds = time.monotonic() - started
        return Turn(process.returncode or 0, out.decode(errors="replace"), seconds)


AGENTS = (
    Agent("codex", "@openai/codex", NPM_BIN / "codex", "responses", "exec_command"),
    Agent(
        "codex-ws", "@openai/codex", NPM_BIN / "codex", "responses", "exec_command", websocket=True
    ),
    Agent("claude", "@anthropic-ai/claude-code", NPM_BIN / "claude", "messages", "Bash"),
    Agent("opencode", "opencode-ai", NPM_BIN / "opencode", "chat", "bash"),
    Agent("continue", "@continuedev/cli", NPM_BIN / "cn", "chat", "List"),
    # aider speaks chat completions without tools: its edits are text in its own formats.
    Agent("aider", "aider-chat", AIDER_BIN, "chat", None),
)


def workdir(path: Path) -> Path:
    """A small git repository for the agent to work in (some agents look for one)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "README.md").write_text("# scratch\n\nA folder an agent may look at.\n")
    subprocess.run(["git", "init", "-q", str(path)], check=True, capture_output=True)
    return path
