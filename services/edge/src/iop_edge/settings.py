"""Settings of the edge, validated once at start (see `iop_proto.service.settings`)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from iop_edge.domain.affinity import AffinityPolicy
from iop_edge.domain.outliers import OutlierPolicy
from iop_edge.domain.queue import DEFAULT_MAX_SHARE
from iop_edge.domain.warmth import WarmPolicy
from iop_proto.framing import DEFAULT_MAX_FRAME_SIZE
from iop_proto.postgres import PostgresSettings
from iop_proto.service import DrainingSettings
from iop_proto.service.settings import FrozenModel
from iop_proto.tracing import TracingSettings


class HttpSettings(FrozenModel):
    """The public OpenAI-compatible API."""

    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535, description="0 picks a free port")
    read_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description=(
            "slow clients are cut after this: a request's headers must arrive within it of the"
            " connection opening (or of the previous answer, so idle keep-alive connections"
            " close after it too); a body still arriving must grow by min_body_rate over each"
            " such period"
        ),
    )
    max_connections: int = Field(
        default=512,
        ge=1,
        description=(
            "client connections served at once; over it a new one is answered a canned 503"
            " (too_many_connections, Retry-After: 1) before any of it is parsed, so a flood"
            " cannot starve the node links that share the edge's event loop; each streaming"
            " or queued request holds one"
        ),
    )
    backlog: int = Field(
        default=1024,
        ge=1,
        description=(
            "connections the kernel queues while the API is at max_connections with as many"
            " refusals still closing (capped by net.core.somaxconn); beyond it clients'"
            " connection attempts are retried by their TCP stack"
        ),
    )
    min_body_rate: int = Field(
        default=16 * 1024,
        ge=1,
        description="bytes a second a request body still arriving must grow by (read_timeout_s)",
    )
    allow_open: bool = Field(
        default=False,
        description=(
            "while no API keys are configured, serve clients on any address; by default only"
            " loopback ones (127.0.0.0/8, ::1) are, others get a 401, whatever host binds"
        ),
    )
    cors_origins: tuple[str, ...] = Field(
        default=(),
        description=(
            "browser origins (scheme://host[:port]) allowed to call the API cross-origin,"
            ' or "*" for any; none by default (no CORS headers, preflights not answered)'
        ),
    )


class NodeListenerSettings(FrozenModel):
    """Where nodes and workers dial in (IOP over mTLS)."""

    host: str = "127.0.0.1"
    port: int = Field(default=7000, ge=0, le=65535, description="0 picks a free port")
    handshake_timeout_s: float = Field(
        default=10.0, gt=0, description="a peer whose TLS handshake takes longer is dropped"
    )
    register_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="a peer that sends no register_request this long after its handshake is cut",
    )
    advertise: str | None = Field(
        default=None,
        description=(
            'where nodes and workers reach this listener, "host:port": the control-plane'
            " lists it to every edge's nodes and workers, which dial it too"
            " (docs/ARCHITECTURE.md#several-edges); unset: host and the bound port, unless"
            " host is a wildcard (0.0.0.0, ::), then the edge is not listed"
        ),
    )
    advertise_server_name: str | None = Field(
        default=None,
        description="the name this edge's certificate carries for that address; default: its host",
    )

    @model_validator(mode="after")
    def _advertise_is_an_address(self) -> NodeListenerSettings:
        if self.advertise is not None:
            split_address(self.advertise)
        return self

    def advertised(self, bound_port: int) -> tuple[str, int] | None:
        """The address nodes are told to dial, once the listener is bound (``None``: the
        edge is not listed, no address of it is known to fit)."""
        if self.advertise is not None:
            return split_address(self.advertise)
        if self.host in WILDCARDS:
            return None
        return self.host, bound_port


WILDCARDS = frozenset({"", "0.0.0.0", "::", "[::]"})


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as its host and port."""
    host, colon, port = address.rpartition(":")
    host = host.strip("[]")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f'advertise {address!r} is not "host:port"')
    return host, int(port)


class ControlPlaneAddress(FrozenModel):
    host: str = "127.0.0.1"
    port: int = Field(default=7100, ge=1, le=65535)
    server_name: str | None = Field(
        default=None, description="name the control-plane's certificate must carry; default: host"
    )
    reconnect_max_s: float = Field(
        default=10.0, gt=0, description="longest pause between attempts to reach the control-plane"
    )
    authorize_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="a node's registration waits this long for the control-plane's verdict",
    )
    heartbeat_interval_s: float = Field(
        default=30.0,
        gt=0,
        description=(
            "heartbeats with the control-plane: keep it equal to the control-plane's"
            " heartbeat_interval_s (each side judges the other by its own: 3 missed = dead);"
            " losing this link costs no selection, the cached fleet config is served"
        ),
    )


class AffinitySettings(FrozenModel):
    """Cache affinity: the weights of the selection rule's first steps
    (docs/ARCHITECTURE.md#cache-affinity)."""

    enabled: bool = Field(
        default=True,
        description="prefer the provider holding a request's session or prompt prefix",
    )
    load_factor: float = Field(
        default=1.25,
        ge=1.0,
        description=(
            "bounded load: a provider is preferred for its cache only while it stays within"
            " this many times its share of the pool's load (runs and waiters)"
        ),
    )
    min_match_blocks: int = Field(
        default=2,
        ge=1,
        description="blocks of 256 characters a cached prefix must match to steer a request",
    )
    max_wait_s: float = Field(
        default=5.0,
        ge=0,
        description=(
            "the longest a request waits for a busy provider holding its cache, instead of"
            " a free slot elsewhere; it waits at most the re-prefill it saves; 0: never"
        ),
    )
    default_prefill_ms_per_token: float = Field(
        default=1.0,
        gt=0,
        description="prefill time per token assumed for an engine whose node reports none",
    )
    max_sessions: int = Field(
        default=100_000, ge=0, description="sessions remembered (least recently used go)"
    )
    session_ttl_s: float = Field(default=3600.0, gt=0, description="a session forgotten after")
    max_prefix_blocks: int = Field(
        default=65_536,
        ge=0,
        description="prefix blocks remembered of what was sent where (~300 bytes each)",
    )
    prefix_ttl_s: float = Field(
        default=900.0, gt=0, description="a prefix sent this long ago no longer matches"
    )

    @property
    def policy(self) -> AffinityPolicy:
        return AffinityPolicy(
            enabled=self.enabled,
            load_factor=self.load_factor,
            min_match_blocks=self.min_match_blocks,
            max_wait_s=self.max_wait_s,
            default_prefill_ms_per_token=self.default_prefill_ms_per_token,
            max_sessions=self.max_sessions,
            session_ttl_s=self.session_ttl_s,
            max_prefix_blocks=self.max_prefix_blocks,
            prefix_ttl_s=self.prefix_ttl_s,
        )


class WarmSettings(FrozenModel):
    """Warm-aware scheduling, for providers that load models on demand
    (docs/ARCHITECTURE.md#warm-aware-scheduling)."""

    enabled: bool = Field(
        default=True, description="prefer providers that hold the model; hold while one loads it"
    )
    hold_factor: float = Field(
        default=2.0,
        ge=0,
        description="a model's requests wait for the host loading (or serving) it this many"
        " times its measured load time before another host loads it too",
    )
    assumed_load_s: float = Field(
        default=5.0, gt=0, description="the load time assumed before one was measured"
    )
    max_hold_s: float = Field(default=30.0, ge=0, description="the longest such wait")
    group_grants: int = Field(
        default=8,
        ge=1,
        description="a host that swaps: freed slots in a row its loaded model takes while"
        " another of its models waits",
    )
    group_wait_s: float = Field(
        default=10.0,
        ge=0,
        description="a host that swaps: how long another model's request waits for it to"
        " finish the loaded model's work before it swaps",
    )

    @property
    def policy(self) -> WarmPolicy:
        return WarmPolicy(
            enabled=self.enabled,
            hold_factor=self.hold_factor,
            assumed_load_s=self.assumed_load_s,
            max_hold_s=self.max_hold_s,
            group_grants=self.group_grants,
            group_wait_s=self.group_wait_s,
        )


DAY_S = 86_400
GIB = 1024**3


class BatchSettings(FrozenModel):
    """Batch lines as backfill (docs/ARCHITECTURE.md#fair-queueing)."""

    max_share: float = Field(
        default=DEFAULT_MAX_SHARE,
        gt=0,
        le=1,
        description=(
            "the share of a model's slots batch lines may hold at once (at least one slot):"
            " the rest stays free for interactive requests; 1 (the default) lets batch fill"
            " an idle pool, preemption giving slots back; lower it where lines are long"
        ),
    )
    preempt: bool = Field(
        default=True,
        description=(
            "an interactive request that finds no free slot takes one from a running batch"
            " line of its model (the line runs again; nothing is lost or done twice)"
        ),
    )


class StorageSettings(FrozenModel):
    """What a key may keep on the edge (stored Responses, Files API files), and for how
    long (docs/ARCHITECTURE.md#stored-responses-and-files)."""

    responses_ttl_s: int = Field(
        default=30 * DAY_S,
        ge=0,
        description="a stored response expires this long after it was made (404); 0 = never",
    )
    responses_quota_bytes: int = Field(
        default=1 * GIB,
        ge=0,
        description=(
            "bytes of stored responses per API key; a store: true request past it is refused"
            " (400 storage_quota_exceeded) before it runs; 0 = no quota"
        ),
    )
    max_conversation_turns: int = Field(
        default=1000,
        ge=1,
        description="turns a previous_response_id chain may hold; past it: 400, compact it",
    )
    files_ttl_s: int = Field(
        default=30 * DAY_S,
        ge=0,
        description="an uploaded or batch result file expires this long after it was made",
    )
    files_quota_bytes: int = Field(
        default=10 * GIB,
        ge=0,
        description="bytes of files per API key; an upload past it is refused; 0 = no quota",
    )
    sweep_interval_s: float = Field(
        default=3600.0, gt=0, description="how often expired and deleted objects are removed"
    )


class EdgeSettings(DrainingSettings):
    """The edge's settings file; `IOP_*` environment variables override any key."""

    service_id: str = "edge"
    http: HttpSettings = HttpSettings()
    node_listener: NodeListenerSettings = NodeListenerSettings()
    control_plane: ControlPlaneAddress = ControlPlaneAddress()
    affinity: AffinitySettings = AffinitySettings()
    warm: WarmSettings = WarmSettings()
    storage: StorageSettings = StorageSettings()
    batch: BatchSettings = BatchSettings()
    tracing: TracingSettings = Field(
        default=TracingSettings(),
        description="spans over OTLP/HTTP (docs/ARCHITECTURE.md#traces); off by default",
    )
    postgres: PostgresSettings | None = Field(
        default=None,
        description="the shared store of several edges (files, batches, stored responses, "
        "the run log); unset: SQLite files beside this edge",
    )
    config_cache: Path = Field(
        default=Path("var/edge/fleet-config.pb"),
        description="the last good fleet config, served while the control-plane is away",
    )
    history_db: Path = Field(default=Path("var/edge/runs.db"), description="runs dispatched")
    responses_db: Path = Field(
        default=Path("var/edge/responses.db"),
        description="Responses API answers kept (store: true) per API key, owner-only",
    )
    reasoning_key_file: Path | None = Field(
        default=None,
        description=(
            "key that seals the reasoning a Responses client keeps (encrypted_content):"
            " 64 hex digits (openssl rand -hex 32) or base64 of 32 bytes; give every edge of"
            " the fleet the same file so any opens what another sealed. Unset: a random key"
            " per process, so sealed reasoning opens only on this edge until it restarts"
        ),
    )
    batch_db: Path = Field(
        default=Path("var/edge/batches.db"),
        description="Batch API files, batches, line results (file contents in <name>.files/)",
    )
    qualification_db: Path | None = Field(
        default=None,
        description=(
            "qualification reports (iopctl qualify); unset: qualifications.db beside history_db"
        ),
    )
    batch_lease_ttl_s: float = Field(
        default=30.0, gt=0, description="a worker that stops renewing loses its batch after this"
    )
    key_slot_ttl_s: float = Field(
        default=30.0,
        gt=0,
        description=(
            "with postgres: an API key's slot held by an edge that stops renewing it (killed,"
            " cut off) frees itself after this; edges renew every third of it"
        ),
    )
    heartbeat_interval_s: float = Field(
        default=2.0,
        gt=0,
        description=(
            "with nodes and workers (they take the edge's): a peer silent for 3 intervals is"
            " dead, a node's providers leave selection at once"
        ),
    )
    run_ack_timeout_s: float = Field(
        default=2.0,
        ge=0,
        description=(
            "a run its node has not acknowledged this long after it was sent (plus 1 s per"
            " MiB of its body, which the node reads first) fails (provider_unavailable) and"
            " the node's providers leave selection until its next snapshot; 0 = off (nodes"
            " of older versions, which do not acknowledge, never are timed)"
        ),
    )
    stall_timeout_s: float = Field(
        default=30.0,
        ge=0,
        description=(
            "a streamed run whose node sends nothing for this long after its first delta"
            " (between events) fails (provider_timeout); before the first delta"
            " first_token_timeout_s holds; non-streamed runs are bound by their request"
            " timeout only; 0 = off"
        ),
    )
    first_token_timeout_s: float = Field(
        default=300.0,
        ge=0,
        description=(
            "a streamed run with no delta this long after it was sent fails"
            " (provider_timeout): the node's queue, a busy engine slot and the prompt's"
            " prefill (minutes for a long prompt on a CPU) come before the first token, and"
            " the stall bound would cut them off; the request deadline bounds it too;"
            " 0 = only the deadline"
        ),
    )
    max_frame_size: int = Field(
        default=DEFAULT_MAX_FRAME_SIZE,
        ge=1024 * 1024,
        description=(
            "largest IOP frame, in bytes (nodes must take as much): a run travels to its node"
            " in one, so the HTTP body limit is this minus 64 KiB (iop_edge.service.limits)"
        ),
    )
    deadline_grace_s: float = Field(
        default=5.0,
        gt=0,
        description=(
            "a run the node has not ended this long after its deadline (the node enforces it)"
            " is failed here: it only catches a silent node"
        ),
    )
    outlier_consecutive_failures: int = Field(
        default=5,
        ge=0,
        description=(
            "provider failures in a row (unreachable, timed out, 5xx) that eject a provider"
            " from selection for outlier_cooldown_s, after which one trial run decides; 0: off"
        ),
    )
    outlier_cooldown_s: float = Field(
        default=30.0,
        gt=0,
        description=(
            "how long a first ejection lasts; each further ejection in a row (a failed"
            " trial) lasts one more of it, up to outlier_max_cooldown_s"
        ),
    )
    outlier_max_cooldown_s: float = Field(
        default=300.0, gt=0, description="the longest an ejection lasts"
    )
    outlier_max_ejection_percent: float = Field(
        default=10.0,
        ge=0,
        le=100,
        description=(
            "the most of a model's providers ejected at once, in percent (Envoy's"
            " max_ejection_percent); the first ejection of a model is always allowed, so at"
            " the default a model of up to 19 providers has one ejected at most"
        ),
    )
    mock_drills: bool = Field(
        default=False,
        description=(
            "honour the mock provider's failure drills (iop_mock fail, status, after_tokens,"
            " delay_ms) from every caller; off: from operator keys only, any other request"
            " asking one is refused (400). A test fleet's switch, off in a real one"
        ),
    )

    @model_validator(mode="after")
    def _cooldowns_fit(self) -> EdgeSettings:
        if self.outlier_max_cooldown_s < self.outlier_cooldown_s:
            raise ValueError(
                f"outlier_max_cooldown_s ({self.outlier_max_cooldown_s}) must not be below"
                f" outlier_cooldown_s ({self.outlier_cooldown_s})"
            )
        return self

    @property
    def outliers(self) -> OutlierPolicy:
        """The outlier ejection policy these settings give."""
        return OutlierPolicy(
            self.outlier_consecutive_failures,
            self.outlier_cooldown_s,
            self.outlier_max_cooldown_s,
            self.outlier_max_ejection_percent,
        )

    @property
    def qualifications_path(self) -> Path:
        """Where this edge keeps qualification reports on SQLite."""
        return self.qualification_db or self.history_db.with_name("qualifications.db")
