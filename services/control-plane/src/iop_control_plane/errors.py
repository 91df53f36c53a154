"""The control-plane's exception hierarchy: one root, expected failures below it."""

from __future__ import annotations


class ControlPlaneError(Exception):
    """Root of every error the control-plane raises on purpose."""


class FleetConfigError(ControlPlaneError, ValueError):
    """A fleet file was refused; ``problems`` names each offending entry."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: fleet configuration refused:\n  " + "\n  ".join(problems))


class CredentialError(ControlPlaneError):
    """A token or key operation could not be done (unknown id, bad arguments)."""
