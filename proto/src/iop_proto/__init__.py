"""The IOP contract package: the only code the four services share.

``iop_proto.v1`` holds the generated messages, ``framing`` the length-prefixed
wire format, ``tls`` the mTLS context builders, ``connection`` the envelope
connection with heartbeats, and ``service`` the boot kit (settings, logging,
admin port, graceful shutdown) so every service starts and stops the same way.
What more than one service does is written once here too: ``sqlite`` (the state
file opener and batched writer), ``dialer`` (dial, register, reconnect) and
``tasks`` (cancelling background tasks).
"""

__version__ = "0.1.0"
