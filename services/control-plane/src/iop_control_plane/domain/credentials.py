"""Node tokens and API keys: how secrets are made, what of them is kept, and how they are checked.

A secret is shown once, when it is issued; only its SHA-256 is stored and compared.
A slow password hash (bcrypt, argon2) would buy nothing here: the secrets are 256
random bits, not something a person chose, so no dictionary or brute force can
reach them, and a plain digest lets the edge look a presented key up in a dict
with one hash per request.

Pure: no clock, no storage. Callers pass ``now`` and keep the records.
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Protocol

from iop_control_plane.domain.key_limits import NO_LIMITS, KeyLimits, ModelLimits
from iop_control_plane.errors import CredentialError

NODE_TOKEN_PREFIX = "iopnt_"
"""Marks a node token in a config file or a leaked log, so scanners and people can spot it."""

API_KEY_PREFIX = "sk-iop-"
"""OpenAI-like, so clients and secret scanners that expect ``sk-...`` keys accept it."""

SECRET_BYTES = 32
"""256 bits of randomness per secret: what makes the fast hash below safe."""

TOKEN_ID_PREFIX = "tok_"
KEY_ID_PREFIX = "key_"


def hash_secret(plaintext: str) -> str:
    """The stored, compared form of a secret: SHA-256 of its UTF-8 bytes, in lower-case hex."""
    return hashlib.sha256(plaintext.encode()).hexdigest()


def as_utc(moment: datetime) -> datetime:
    """``moment`` in UTC; a naive datetime is refused because its zone would be a guess."""
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise ValueError(f"timestamp {moment.isoformat()} has no time zone")
    return moment.astimezone(UTC)


@dataclass(frozen=True, slots=True)
class Rotation:
    """A credential's previous secret after ``rotate``: still accepted until ``until``
    (the end of the overlap), so clients and nodes can move to the new one without a cut."""

    previous_hash: str = field(repr=False)
    until: datetime


class _Expiring(Protocol):
    @property
    def secret_hash(self) -> str: ...
    @property
    def expires_at(self) -> datetime | None: ...
    @property
    def rotation(self) -> Rotation | None: ...


def secret_expiry(record: _Expiring, secret_hash: str) -> datetime | None:
    """When the secret hashing to ``secret_hash`` stops being accepted for ``record``
    (``None``: never). The previous secret of a rotation ends with its overlap, or with
    the credential itself if that comes first; a hash of neither has already ended."""
    if secret_hash == record.secret_hash:
        return record.expires_at
    rotation = record.rotation
    if rotation is None or secret_hash != rotation.previous_hash:
        return datetime.min.replace(tzinfo=UTC)
    ends = record.expires_at
    return rotation.until if ends is None else min(rotation.until, ends)


def accepts(record: _Expiring, secret_hash: str, now: datetime) -> bool:
    """Whether ``secret_hash`` (the hash of a presented secret) is still good at ``now``;
    revocation is the caller's to check, as before."""
    ends = secret_expiry(record, secret_hash)
    return ends is None or as_utc(now) < ends


def expires_after(now: datetime, seconds: float | None, at: datetime | None) -> datetime | None:
    """An expiry given as a duration from ``now`` or as a moment (at most one of them);
    ``CredentialError`` for one not in the future."""
    if seconds is not None and at is not None:
        raise CredentialError("give an expiry as a duration or as a moment, not both")
    if seconds is not None:
        at = as_utc(now) + timedelta(seconds=seconds)
    if at is not None and as_utc(at) <= as_utc(now):
        raise CredentialError(f"the expiry {as_utc(at).isoformat()} is not in the future")
    return None if at is None else as_utc(at)


@dataclass(frozen=True, slots=True)
class NodeToken:
    """What is kept of a node token: who it is for, when it was made and revoked, not the secret."""

    token_id: str
    node_id: str
    secret_hash: str = field(repr=False)
    created_at: datetime
    revoked_at: datetime | None = None
    expires_at: datetime | None = None  # None: never
    rotation: Rotation | None = None  # the secret it had before its last rotation

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    def revoke(self, now: datetime) -> NodeToken:
        """This token revoked at ``now``; an earlier revocation time stands."""
        if self.revoked_at is not None:
            return self
        return dataclasses.replace(self, revoked_at=as_utc(now))


@dataclass(frozen=True, slots=True)
class ApiKey:
    """What is kept of an API key: its policy and history, not the secret.

    ``models`` empty means every model; ``max_concurrent`` 0 means no limit. An
    ``operator`` key sees every key's runs, files and batches at the edge (the
    console's key); it is still bound by ``models`` for inference. ``limits``,
    ``model_limits``, ``weight`` and ``priority``: what the edge holds the key to
    (``domain.key_limits``; docs/ARCHITECTURE.md#limits-per-key).
    """

    key_id: str
    name: str
    secret_hash: str = field(repr=False)
    models: tuple[str, ...]
    max_concurrent: int
    created_at: datetime
    revoked_at: datetime | None = None
    operator: bool = False
    limits: KeyLimits = NO_LIMITS
    model_limits: ModelLimits = ()
    weight: int = 1  # its share of turns in a model's queue
    priority: int = 0  # higher is served first
    expires_at: datetime | None = None  # None: never
    rotation: Rotation | None = None  # the secret it had before its last rotation

    def __post_init__(self) -> None:
        if self.weight < 1:
            raise CredentialError(f"weight must be 1 or more (got {self.weight})")

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    def allows_model(self, model: str) -> bool:
        """Whether this key's policy names ``model`` (an empty list allows every model)."""
        return not self.models or model in self.models

    def revoke(self, now: datetime) -> ApiKey:
        """This key revoked at ``now``; an earlier revocation time stands."""
        if self.revoked_at is not None:
            return self
        return dataclasses.replace(self, revoked_at=as_utc(now))


@dataclass(frozen=True, slots=True)
class IssuedToken:
    """A new node token and its plaintext: the only time the plaintext exists outside the node."""

    token: NodeToken
    plaintext: str = field(repr=False)  # repr=False: logging this object must not leak it


@dataclass(frozen=True, slots=True)
class IssuedKey:
    """A new API key and its plaintext: the only time the plaintext exists outside the client."""

    key: ApiKey
    plaintext: str = field(repr=False)


def new_node_token(
    node_id: str, now: datetime, *, expires_at: datetime | None = None
) -> IssuedToken:
    """Make a token for ``node_id``; store ``.token``, hand ``.plaintext`` to the operator once."""
    node_id = node_id.strip()
    if not node_id:
        raise CredentialError("a node token needs a node id (got an empty one)")
    plaintext = NODE_TOKEN_PREFIX + secrets.token_urlsafe(SECRET_BYTES)
    token = NodeToken(
        token_id=TOKEN_ID_PREFIX + secrets.token_hex(4),
        node_id=node_id,
        secret_hash=hash_secret(plaintext),
        created_at=as_utc(now),
        expires_at=expires_after(now, None, expires_at),
    )
    return IssuedToken(token=token, plaintext=plaintext)


def new_api_key(
    name: str,
    models: Iterable[str],
    max_concurrent: int,
    now: datetime,
    *,
    operator: bool = False,
    limits: KeyLimits = NO_LIMITS,
    weight: int = 1,
    priority: int = 0,
    expires_at: datetime | None = None,
) -> IssuedKey:
    """Make an API key named ``name`` limited to ``models`` (none: all) and ``max_concurrent``;
    ``operator`` lets it see every key's work at the edge.

    Model names are stripped and de-duplicated, first occurrence kept.
    """
    name = name.strip()
    if not name:
        raise CredentialError("an API key needs a name (got an empty one)")
    if isinstance(models, str):
        # A bare string is an iterable of one-letter "models": certainly a caller's mistake.
        raise TypeError("models must be a collection of model names, not one string")
    names: dict[str, None] = {}
    for model in models:
        model = model.strip()
        if not model:
            raise CredentialError("an API key's model list has an empty model name")
        names[model] = None
    if max_concurrent < 0:
        raise CredentialError(
            f"max_concurrent must be 0 (unlimited) or more (got {max_concurrent})"
        )
    plaintext = API_KEY_PREFIX + secrets.token_urlsafe(SECRET_BYTES)
    key = ApiKey(
        key_id=KEY_ID_PREFIX + secrets.token_hex(4),
        name=name,
        secret_hash=hash_secret(plaintext),
        models=tuple(names),
        max_concurrent=max_concurrent,
        created_at=as_utc(now),
        operator=operator,
        limits=limits,
        weight=weight,
        priority=priority,
        expires_at=expires_after(now, None, expires_at),
    )
    return IssuedKey(key=key, plaintext=plaintext)


def updated_key(asked: ApiKey, stored: list[ApiKey]) -> ApiKey:
    """What a store's ``update_api_key`` returns: the stored key (``stored``, read after
    the update: none or one), or ``CredentialError`` saying why ``asked`` was not stored."""
    if not stored:
        raise CredentialError(f"no API key with id {asked.key_id!r}")
    [key] = stored
    if key.revoked:
        raise CredentialError(f"API key {asked.key_id} is revoked; issue a new one")
    return key


def new_secret(prefix: str) -> tuple[str, str]:
    """A fresh secret with ``prefix`` and its hash: what ``rotate`` stores and hands out."""
    plaintext = prefix + secrets.token_urlsafe(SECRET_BYTES)
    return plaintext, hash_secret(plaintext)


def rotation_of(
    record: _Expiring, revoked: bool, what: str, now: datetime, overlap_s: float
) -> Rotation:
    """The ``Rotation`` a ``rotate`` of ``record`` keeps: its current secret, accepted for
    ``overlap_s`` more seconds (0: not at all). A revoked or expired credential is not
    rotated: it has no secret left to overlap with, and reviving it is ``issue``'s job."""
    if revoked:
        raise CredentialError(f"{what} is revoked; issue a new one")
    if not accepts(record, record.secret_hash, now):
        raise CredentialError(f"{what} has expired; issue a new one")
    if overlap_s < 0:
        raise CredentialError(f"the overlap must be 0 or more seconds (got {overlap_s})")
    until = as_utc(now) + timedelta(seconds=overlap_s)
    return Rotation(previous_hash=record.secret_hash, until=until)


def parse_duration(text: str) -> float:
    """Seconds in ``30d``, ``24h``, ``90m``, ``45s`` or a bare number of seconds (the CLI's
    ``--expires-in`` and ``--overlap``); ``CredentialError`` for anything else."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    text = text.strip().lower()
    scale = units.get(text[-1:])
    number = text[:-1] if scale is not None else text
    try:
        value = float(number)
    except ValueError:
        raise CredentialError(
            f"{text!r} is not a duration (say 30d, 24h, 90m, 45s or seconds)"
        ) from None
    if value < 0 or value != value:  # NaN is not a duration either
        raise CredentialError(f"a duration must be 0 or more (got {text!r})")
    return value * (scale or 1)
