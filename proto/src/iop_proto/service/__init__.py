"""The boot kit every IOP service uses: settings, logging, admin port, run-until-signal.

It lives in the contract package because the four services may share nothing
else; keeping one copy means they all validate, log and shut down the same way.
"""

from iop_proto.service.admin import AdminServer
from iop_proto.service.runner import run_service
from iop_proto.service.settings import (
    AdminSettings,
    DrainingSettings,
    LogSettings,
    ServiceSettings,
    load_settings,
)

__all__ = [
    "AdminServer",
    "AdminSettings",
    "DrainingSettings",
    "LogSettings",
    "ServiceSettings",
    "load_settings",
    "run_service",
]
