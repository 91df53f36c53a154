from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_UNSPECIFIED: _ClassVar[ErrorCode]
    ERROR_CODE_BAD_FRAME: _ClassVar[ErrorCode]
    ERROR_CODE_FRAME_TOO_LARGE: _ClassVar[ErrorCode]
    ERROR_CODE_UNEXPECTED_MESSAGE: _ClassVar[ErrorCode]
    ERROR_CODE_HEARTBEAT_TIMEOUT: _ClassVar[ErrorCode]
    ERROR_CODE_UNAUTHENTICATED: _ClassVar[ErrorCode]
    ERROR_CODE_PERMISSION_DENIED: _ClassVar[ErrorCode]
    ERROR_CODE_SHUTTING_DOWN: _ClassVar[ErrorCode]
    ERROR_CODE_INVALID_REQUEST: _ClassVar[ErrorCode]
    ERROR_CODE_NOT_FOUND: _ClassVar[ErrorCode]
    ERROR_CODE_QUEUE_FULL: _ClassVar[ErrorCode]
    ERROR_CODE_QUEUE_TIMEOUT: _ClassVar[ErrorCode]
    ERROR_CODE_PROVIDER_UNAVAILABLE: _ClassVar[ErrorCode]
    ERROR_CODE_PROVIDER_ERROR: _ClassVar[ErrorCode]
    ERROR_CODE_PROVIDER_TIMEOUT: _ClassVar[ErrorCode]
    ERROR_CODE_CANCELLED: _ClassVar[ErrorCode]
    ERROR_CODE_DEADLINE_EXCEEDED: _ClassVar[ErrorCode]
    ERROR_CODE_INTERNAL: _ClassVar[ErrorCode]
    ERROR_CODE_CONTEXT_LENGTH_EXCEEDED: _ClassVar[ErrorCode]

class PeerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PEER_ROLE_UNSPECIFIED: _ClassVar[PeerRole]
    PEER_ROLE_NODE: _ClassVar[PeerRole]
    PEER_ROLE_WORKER: _ClassVar[PeerRole]

class Health(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HEALTH_UNKNOWN: _ClassVar[Health]
    HEALTH_AVAILABLE: _ClassVar[Health]
    HEALTH_UNAVAILABLE: _ClassVar[Health]

class ProviderCategory(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROVIDER_CATEGORY_UNSPECIFIED: _ClassVar[ProviderCategory]
    PROVIDER_CATEGORY_API: _ClassVar[ProviderCategory]
    PROVIDER_CATEGORY_CLI: _ClassVar[ProviderCategory]
    PROVIDER_CATEGORY_LOCAL_INFERENCE: _ClassVar[ProviderCategory]

class Operation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OPERATION_UNSPECIFIED: _ClassVar[Operation]
    OPERATION_CHAT_COMPLETIONS: _ClassVar[Operation]
    OPERATION_COMPLETIONS: _ClassVar[Operation]
    OPERATION_EMBEDDINGS: _ClassVar[Operation]
    OPERATION_COUNT_TOKENS: _ClassVar[Operation]

class BudgetPeriod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BUDGET_PERIOD_UNSPECIFIED: _ClassVar[BudgetPeriod]
    BUDGET_PERIOD_DAY: _ClassVar[BudgetPeriod]
    BUDGET_PERIOD_WEEK: _ClassVar[BudgetPeriod]
    BUDGET_PERIOD_MONTH: _ClassVar[BudgetPeriod]
ERROR_CODE_UNSPECIFIED: ErrorCode
ERROR_CODE_BAD_FRAME: ErrorCode
ERROR_CODE_FRAME_TOO_LARGE: ErrorCode
ERROR_CODE_UNEXPECTED_MESSAGE: ErrorCode
ERROR_CODE_HEARTBEAT_TIMEOUT: ErrorCode
ERROR_CODE_UNAUTHENTICATED: ErrorCode
ERROR_CODE_PERMISSION_DENIED: ErrorCode
ERROR_CODE_SHUTTING_DOWN: ErrorCode
ERROR_CODE_INVALID_REQUEST: ErrorCode
ERROR_CODE_NOT_FOUND: ErrorCode
ERROR_CODE_QUEUE_FULL: ErrorCode
ERROR_CODE_QUEUE_TIMEOUT: ErrorCode
ERROR_CODE_PROVIDER_UNAVAILABLE: ErrorCode
ERROR_CODE_PROVIDER_ERROR: ErrorCode
ERROR_CODE_PROVIDER_TIMEOUT: ErrorCode
ERROR_CODE_CANCELLED: ErrorCode
ERROR_CODE_DEADLINE_EXCEEDED: ErrorCode
ERROR_CODE_INTERNAL: ErrorCode
ERROR_CODE_CONTEXT_LENGTH_EXCEEDED: ErrorCode
PEER_ROLE_UNSPECIFIED: PeerRole
PEER_ROLE_NODE: PeerRole
PEER_ROLE_WORKER: PeerRole
HEALTH_UNKNOWN: Health
HEALTH_AVAILABLE: Health
HEALTH_UNAVAILABLE: Health
PROVIDER_CATEGORY_UNSPECIFIED: ProviderCategory
PROVIDER_CATEGORY_API: ProviderCategory
PROVIDER_CATEGORY_CLI: ProviderCategory
PROVIDER_CATEGORY_LOCAL_INFERENCE: ProviderCategory
OPERATION_UNSPECIFIED: Operation
OPERATION_CHAT_COMPLETIONS: Operation
OPERATION_COMPLETIONS: Operation
OPERATION_EMBEDDINGS: Operation
OPERATION_COUNT_TOKENS: Operation
BUDGET_PERIOD_UNSPECIFIED: BudgetPeriod
BUDGET_PERIOD_DAY: BudgetPeriod
BUDGET_PERIOD_WEEK: BudgetPeriod
BUDGET_PERIOD_MONTH: BudgetPeriod

class Envelope(_message.Message):
    __slots__ = ("message_id", "correlation_id", "sent_at_unix_ms", "register_request", "register_response", "heartbeat", "provider_snapshot", "run_request", "run_event", "cancel_request", "error", "edge_hello", "fleet_config", "authorize_node_request", "authorize_node_response", "node_status_report", "runtime_control_request", "runtime_control_response", "lease_request", "lease_grant", "lease_renew", "lease_release", "batch_line_request", "batch_line_result")
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    CORRELATION_ID_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    REGISTER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    REGISTER_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    RUN_REQUEST_FIELD_NUMBER: _ClassVar[int]
    RUN_EVENT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_REQUEST_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    EDGE_HELLO_FIELD_NUMBER: _ClassVar[int]
    FLEET_CONFIG_FIELD_NUMBER: _ClassVar[int]
    AUTHORIZE_NODE_REQUEST_FIELD_NUMBER: _ClassVar[int]
    AUTHORIZE_NODE_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    NODE_STATUS_REPORT_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_CONTROL_REQUEST_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_CONTROL_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    LEASE_REQUEST_FIELD_NUMBER: _ClassVar[int]
    LEASE_GRANT_FIELD_NUMBER: _ClassVar[int]
    LEASE_RENEW_FIELD_NUMBER: _ClassVar[int]
    LEASE_RELEASE_FIELD_NUMBER: _ClassVar[int]
    BATCH_LINE_REQUEST_FIELD_NUMBER: _ClassVar[int]
    BATCH_LINE_RESULT_FIELD_NUMBER: _ClassVar[int]
    message_id: str
    correlation_id: str
    sent_at_unix_ms: int
    register_request: RegisterRequest
    register_response: RegisterResponse
    heartbeat: Heartbeat
    provider_snapshot: ProviderSnapshot
    run_request: RunRequest
    run_event: RunEvent
    cancel_request: CancelRequest
    error: Error
    edge_hello: EdgeHello
    fleet_config: FleetConfig
    authorize_node_request: AuthorizeNodeRequest
    authorize_node_response: AuthorizeNodeResponse
    node_status_report: NodeStatusReport
    runtime_control_request: RuntimeControlRequest
    runtime_control_response: RuntimeControlResponse
    lease_request: LeaseRequest
    lease_grant: LeaseGrant
    lease_renew: LeaseRenew
    lease_release: LeaseRelease
    batch_line_request: BatchLineRequest
    batch_line_result: BatchLineResult
    def __init__(self, message_id: _Optional[str] = ..., correlation_id: _Optional[str] = ..., sent_at_unix_ms: _Optional[int] = ..., register_request: _Optional[_Union[RegisterRequest, _Mapping]] = ..., register_response: _Optional[_Union[RegisterResponse, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., provider_snapshot: _Optional[_Union[ProviderSnapshot, _Mapping]] = ..., run_request: _Optional[_Union[RunRequest, _Mapping]] = ..., run_event: _Optional[_Union[RunEvent, _Mapping]] = ..., cancel_request: _Optional[_Union[CancelRequest, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., edge_hello: _Optional[_Union[EdgeHello, _Mapping]] = ..., fleet_config: _Optional[_Union[FleetConfig, _Mapping]] = ..., authorize_node_request: _Optional[_Union[AuthorizeNodeRequest, _Mapping]] = ..., authorize_node_response: _Optional[_Union[AuthorizeNodeResponse, _Mapping]] = ..., node_status_report: _Optional[_Union[NodeStatusReport, _Mapping]] = ..., runtime_control_request: _Optional[_Union[RuntimeControlRequest, _Mapping]] = ..., runtime_control_response: _Optional[_Union[RuntimeControlResponse, _Mapping]] = ..., lease_request: _Optional[_Union[LeaseRequest, _Mapping]] = ..., lease_grant: _Optional[_Union[LeaseGrant, _Mapping]] = ..., lease_renew: _Optional[_Union[LeaseRenew, _Mapping]] = ..., lease_release: _Optional[_Union[LeaseRelease, _Mapping]] = ..., batch_line_request: _Optional[_Union[BatchLineRequest, _Mapping]] = ..., batch_line_result: _Optional[_Union[BatchLineResult, _Mapping]] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message", "run_id")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    code: ErrorCode
    message: str
    run_id: str
    def __init__(self, code: _Optional[_Union[ErrorCode, str]] = ..., message: _Optional[str] = ..., run_id: _Optional[str] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("peer_id", "token", "version", "role", "providers", "acknowledges_runs", "follows_edges")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PROVIDERS_FIELD_NUMBER: _ClassVar[int]
    ACKNOWLEDGES_RUNS_FIELD_NUMBER: _ClassVar[int]
    FOLLOWS_EDGES_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    token: str
    version: str
    role: PeerRole
    providers: _containers.RepeatedCompositeFieldContainer[ProviderState]
    acknowledges_runs: bool
    follows_edges: bool
    def __init__(self, peer_id: _Optional[str] = ..., token: _Optional[str] = ..., version: _Optional[str] = ..., role: _Optional[_Union[PeerRole, str]] = ..., providers: _Optional[_Iterable[_Union[ProviderState, _Mapping]]] = ..., acknowledges_runs: _Optional[bool] = ..., follows_edges: _Optional[bool] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("accepted", "reason", "node_config", "heartbeat_interval_ms", "edge_id", "takes_folded_completions", "takes_provider_load", "edges")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NODE_CONFIG_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    EDGE_ID_FIELD_NUMBER: _ClassVar[int]
    TAKES_FOLDED_COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    TAKES_PROVIDER_LOAD_FIELD_NUMBER: _ClassVar[int]
    EDGES_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    node_config: NodeConfig
    heartbeat_interval_ms: int
    edge_id: str
    takes_folded_completions: bool
    takes_provider_load: bool
    edges: _containers.RepeatedCompositeFieldContainer[EdgeEndpoint]
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., node_config: _Optional[_Union[NodeConfig, _Mapping]] = ..., heartbeat_interval_ms: _Optional[int] = ..., edge_id: _Optional[str] = ..., takes_folded_completions: _Optional[bool] = ..., takes_provider_load: _Optional[bool] = ..., edges: _Optional[_Iterable[_Union[EdgeEndpoint, _Mapping]]] = ...) -> None: ...

class EdgeEndpoint(_message.Message):
    __slots__ = ("edge_id", "host", "port", "server_name")
    EDGE_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    SERVER_NAME_FIELD_NUMBER: _ClassVar[int]
    edge_id: str
    host: str
    port: int
    server_name: str
    def __init__(self, edge_id: _Optional[str] = ..., host: _Optional[str] = ..., port: _Optional[int] = ..., server_name: _Optional[str] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("monotonic_ms",)
    MONOTONIC_MS_FIELD_NUMBER: _ClassVar[int]
    monotonic_ms: int
    def __init__(self, monotonic_ms: _Optional[int] = ...) -> None: ...

class LifecycleCapabilities(_message.Message):
    __slots__ = ("list_models", "load_model", "unload_model", "pull_model", "delete_model")
    LIST_MODELS_FIELD_NUMBER: _ClassVar[int]
    LOAD_MODEL_FIELD_NUMBER: _ClassVar[int]
    UNLOAD_MODEL_FIELD_NUMBER: _ClassVar[int]
    PULL_MODEL_FIELD_NUMBER: _ClassVar[int]
    DELETE_MODEL_FIELD_NUMBER: _ClassVar[int]
    list_models: bool
    load_model: bool
    unload_model: bool
    pull_model: bool
    delete_model: bool
    def __init__(self, list_models: _Optional[bool] = ..., load_model: _Optional[bool] = ..., unload_model: _Optional[bool] = ..., pull_model: _Optional[bool] = ..., delete_model: _Optional[bool] = ...) -> None: ...

class ProviderState(_message.Message):
    __slots__ = ("provider_id", "type", "category", "health", "capacity", "in_flight", "queued", "max_queue", "models", "capabilities", "last_probe_unix_ms", "detail", "cache", "loaded", "engine")
    PROVIDER_ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    LAST_PROBE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    provider_id: str
    type: str
    category: ProviderCategory
    health: Health
    capacity: int
    in_flight: int
    queued: int
    max_queue: int
    models: _containers.RepeatedScalarFieldContainer[str]
    capabilities: LifecycleCapabilities
    last_probe_unix_ms: int
    detail: str
    cache: CacheState
    loaded: LoadedModels
    engine: QualificationEngine
    def __init__(self, provider_id: _Optional[str] = ..., type: _Optional[str] = ..., category: _Optional[_Union[ProviderCategory, str]] = ..., health: _Optional[_Union[Health, str]] = ..., capacity: _Optional[int] = ..., in_flight: _Optional[int] = ..., queued: _Optional[int] = ..., max_queue: _Optional[int] = ..., models: _Optional[_Iterable[str]] = ..., capabilities: _Optional[_Union[LifecycleCapabilities, _Mapping]] = ..., last_probe_unix_ms: _Optional[int] = ..., detail: _Optional[str] = ..., cache: _Optional[_Union[CacheState, _Mapping]] = ..., loaded: _Optional[_Union[LoadedModels, _Mapping]] = ..., engine: _Optional[_Union[QualificationEngine, _Mapping]] = ...) -> None: ...

class LoadedModel(_message.Message):
    __slots__ = ("name", "since_unix_ms", "expires_unix_ms")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SINCE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    name: str
    since_unix_ms: int
    expires_unix_ms: int
    def __init__(self, name: _Optional[str] = ..., since_unix_ms: _Optional[int] = ..., expires_unix_ms: _Optional[int] = ...) -> None: ...

class LoadedTiming(_message.Message):
    __slots__ = ("name", "last_ms", "mean_ms", "loads")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LAST_MS_FIELD_NUMBER: _ClassVar[int]
    MEAN_MS_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    name: str
    last_ms: int
    mean_ms: int
    loads: int
    def __init__(self, name: _Optional[str] = ..., last_ms: _Optional[int] = ..., mean_ms: _Optional[int] = ..., loads: _Optional[int] = ...) -> None: ...

class LoadedModels(_message.Message):
    __slots__ = ("models", "timings", "max_loaded")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    MAX_LOADED_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[LoadedModel]
    timings: _containers.RepeatedCompositeFieldContainer[LoadedTiming]
    max_loaded: int
    def __init__(self, models: _Optional[_Iterable[_Union[LoadedModel, _Mapping]]] = ..., timings: _Optional[_Iterable[_Union[LoadedTiming, _Mapping]]] = ..., max_loaded: _Optional[int] = ...) -> None: ...

class QualificationEngine(_message.Message):
    __slots__ = ("name", "version", "device", "listed_models")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    LISTED_MODELS_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    device: str
    listed_models: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., device: _Optional[str] = ..., listed_models: _Optional[int] = ...) -> None: ...

class CachedPrefix(_message.Message):
    __slots__ = ("tail", "blocks")
    TAIL_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tail: int
    blocks: int
    def __init__(self, tail: _Optional[int] = ..., blocks: _Optional[int] = ...) -> None: ...

class CacheState(_message.Message):
    __slots__ = ("prefixes", "prompt_tokens", "cached_tokens", "prefill_ms_per_token")
    PREFIXES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    prefixes: _containers.RepeatedCompositeFieldContainer[CachedPrefix]
    prompt_tokens: int
    cached_tokens: int
    prefill_ms_per_token: float
    def __init__(self, prefixes: _Optional[_Iterable[_Union[CachedPrefix, _Mapping]]] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., prefill_ms_per_token: _Optional[float] = ...) -> None: ...

class ProviderLoad(_message.Message):
    __slots__ = ("in_flight", "queued", "cache")
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    in_flight: int
    queued: int
    cache: CacheState
    def __init__(self, in_flight: _Optional[int] = ..., queued: _Optional[int] = ..., cache: _Optional[_Union[CacheState, _Mapping]] = ...) -> None: ...

class ProviderSnapshot(_message.Message):
    __slots__ = ("node_id", "providers")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PROVIDERS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    providers: _containers.RepeatedCompositeFieldContainer[ProviderState]
    def __init__(self, node_id: _Optional[str] = ..., providers: _Optional[_Iterable[_Union[ProviderState, _Mapping]]] = ...) -> None: ...

class ProviderConfig(_message.Message):
    __slots__ = ("id", "type", "category", "models", "capacity", "max_queue", "queue_timeout_ms", "request_timeout_ms", "settings_json", "operations", "control_state", "declared_capacity")
    ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_JSON_FIELD_NUMBER: _ClassVar[int]
    OPERATIONS_FIELD_NUMBER: _ClassVar[int]
    CONTROL_STATE_FIELD_NUMBER: _ClassVar[int]
    DECLARED_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    id: str
    type: str
    category: ProviderCategory
    models: _containers.RepeatedScalarFieldContainer[str]
    capacity: int
    max_queue: int
    queue_timeout_ms: int
    request_timeout_ms: int
    settings_json: bytes
    operations: _containers.RepeatedScalarFieldContainer[str]
    control_state: str
    declared_capacity: int
    def __init__(self, id: _Optional[str] = ..., type: _Optional[str] = ..., category: _Optional[_Union[ProviderCategory, str]] = ..., models: _Optional[_Iterable[str]] = ..., capacity: _Optional[int] = ..., max_queue: _Optional[int] = ..., queue_timeout_ms: _Optional[int] = ..., request_timeout_ms: _Optional[int] = ..., settings_json: _Optional[bytes] = ..., operations: _Optional[_Iterable[str]] = ..., control_state: _Optional[str] = ..., declared_capacity: _Optional[int] = ...) -> None: ...

class NodeConfig(_message.Message):
    __slots__ = ("node_id", "providers")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PROVIDERS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    providers: _containers.RepeatedCompositeFieldContainer[ProviderConfig]
    def __init__(self, node_id: _Optional[str] = ..., providers: _Optional[_Iterable[_Union[ProviderConfig, _Mapping]]] = ...) -> None: ...

class RunRequest(_message.Message):
    __slots__ = ("run_id", "model", "provider_id", "adapter", "target", "operation", "body_json", "stream", "deadline_unix_ms", "include_usage", "body_prepared", "prompt_blocks", "traceparent")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    BODY_JSON_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_USAGE_FIELD_NUMBER: _ClassVar[int]
    BODY_PREPARED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    model: str
    provider_id: str
    adapter: str
    target: str
    operation: Operation
    body_json: bytes
    stream: bool
    deadline_unix_ms: int
    include_usage: bool
    body_prepared: bool
    prompt_blocks: _containers.RepeatedScalarFieldContainer[int]
    traceparent: str
    def __init__(self, run_id: _Optional[str] = ..., model: _Optional[str] = ..., provider_id: _Optional[str] = ..., adapter: _Optional[str] = ..., target: _Optional[str] = ..., operation: _Optional[_Union[Operation, str]] = ..., body_json: _Optional[bytes] = ..., stream: _Optional[bool] = ..., deadline_unix_ms: _Optional[int] = ..., include_usage: _Optional[bool] = ..., body_prepared: _Optional[bool] = ..., prompt_blocks: _Optional[_Iterable[int]] = ..., traceparent: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class ToolCallDelta(_message.Message):
    __slots__ = ("index", "id", "type", "function_name", "function_arguments")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_NAME_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    index: int
    id: str
    type: str
    function_name: str
    function_arguments: str
    def __init__(self, index: _Optional[int] = ..., id: _Optional[str] = ..., type: _Optional[str] = ..., function_name: _Optional[str] = ..., function_arguments: _Optional[str] = ...) -> None: ...

class RunStart(_message.Message):
    __slots__ = ("provider_id", "target", "queue_wait_ms")
    PROVIDER_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    provider_id: str
    target: str
    queue_wait_ms: int
    def __init__(self, provider_id: _Optional[str] = ..., target: _Optional[str] = ..., queue_wait_ms: _Optional[int] = ...) -> None: ...

class RunDelta(_message.Message):
    __slots__ = ("choice_index", "role", "text", "tool_calls", "finish_reason", "usage", "reasoning_text", "logprobs_json", "provider_us")
    CHOICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    REASONING_TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_JSON_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_US_FIELD_NUMBER: _ClassVar[int]
    choice_index: int
    role: str
    text: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCallDelta]
    finish_reason: str
    usage: Usage
    reasoning_text: str
    logprobs_json: bytes
    provider_us: int
    def __init__(self, choice_index: _Optional[int] = ..., role: _Optional[str] = ..., text: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCallDelta, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., reasoning_text: _Optional[str] = ..., logprobs_json: _Optional[bytes] = ..., provider_us: _Optional[int] = ...) -> None: ...

class RunComplete(_message.Message):
    __slots__ = ("finish_reason", "usage", "result_json", "provider_us", "start", "load")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    RESULT_JSON_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_US_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    usage: Usage
    result_json: bytes
    provider_us: int
    start: RunStart
    load: ProviderLoad
    def __init__(self, finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., result_json: _Optional[bytes] = ..., provider_us: _Optional[int] = ..., start: _Optional[_Union[RunStart, _Mapping]] = ..., load: _Optional[_Union[ProviderLoad, _Mapping]] = ...) -> None: ...

class RunError(_message.Message):
    __slots__ = ("code", "message", "provider_status", "provider_us", "context_window", "prompt_tokens", "load")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_STATUS_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_US_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_WINDOW_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    code: ErrorCode
    message: str
    provider_status: int
    provider_us: int
    context_window: int
    prompt_tokens: int
    load: ProviderLoad
    def __init__(self, code: _Optional[_Union[ErrorCode, str]] = ..., message: _Optional[str] = ..., provider_status: _Optional[int] = ..., provider_us: _Optional[int] = ..., context_window: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., load: _Optional[_Union[ProviderLoad, _Mapping]] = ...) -> None: ...

class RunAccepted(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunEvent(_message.Message):
    __slots__ = ("run_id", "sequence", "start", "delta", "complete", "error", "accepted")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    sequence: int
    start: RunStart
    delta: RunDelta
    complete: RunComplete
    error: RunError
    accepted: RunAccepted
    def __init__(self, run_id: _Optional[str] = ..., sequence: _Optional[int] = ..., start: _Optional[_Union[RunStart, _Mapping]] = ..., delta: _Optional[_Union[RunDelta, _Mapping]] = ..., complete: _Optional[_Union[RunComplete, _Mapping]] = ..., error: _Optional[_Union[RunError, _Mapping]] = ..., accepted: _Optional[_Union[RunAccepted, _Mapping]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("run_id", "reason")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    reason: str
    def __init__(self, run_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class EdgeHello(_message.Message):
    __slots__ = ("edge_id", "version", "known_config_version", "node_listener")
    EDGE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    KNOWN_CONFIG_VERSION_FIELD_NUMBER: _ClassVar[int]
    NODE_LISTENER_FIELD_NUMBER: _ClassVar[int]
    edge_id: str
    version: str
    known_config_version: int
    node_listener: EdgeEndpoint
    def __init__(self, edge_id: _Optional[str] = ..., version: _Optional[str] = ..., known_config_version: _Optional[int] = ..., node_listener: _Optional[_Union[EdgeEndpoint, _Mapping]] = ...) -> None: ...

class ModelConfig(_message.Message):
    __slots__ = ("id", "display_name", "providers", "max_output_tokens", "retries", "context_window")
    class ProvidersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    DISPLAY_NAME_FIELD_NUMBER: _ClassVar[int]
    PROVIDERS_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETRIES_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_WINDOW_FIELD_NUMBER: _ClassVar[int]
    id: str
    display_name: str
    providers: _containers.ScalarMap[str, str]
    max_output_tokens: int
    retries: int
    context_window: int
    def __init__(self, id: _Optional[str] = ..., display_name: _Optional[str] = ..., providers: _Optional[_Mapping[str, str]] = ..., max_output_tokens: _Optional[int] = ..., retries: _Optional[int] = ..., context_window: _Optional[int] = ...) -> None: ...

class ApiKeyPolicy(_message.Message):
    __slots__ = ("key_id", "name", "key_hash", "models", "max_concurrent", "operator", "limits", "model_limits", "weight", "priority", "expires_unix_ms", "previous_key_hash", "previous_expires_unix_ms")
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    KEY_HASH_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_FIELD_NUMBER: _ClassVar[int]
    OPERATOR_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    MODEL_LIMITS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_KEY_HASH_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    name: str
    key_hash: str
    models: _containers.RepeatedScalarFieldContainer[str]
    max_concurrent: int
    operator: bool
    limits: KeyLimits
    model_limits: _containers.RepeatedCompositeFieldContainer[ModelKeyLimits]
    weight: int
    priority: int
    expires_unix_ms: int
    previous_key_hash: str
    previous_expires_unix_ms: int
    def __init__(self, key_id: _Optional[str] = ..., name: _Optional[str] = ..., key_hash: _Optional[str] = ..., models: _Optional[_Iterable[str]] = ..., max_concurrent: _Optional[int] = ..., operator: _Optional[bool] = ..., limits: _Optional[_Union[KeyLimits, _Mapping]] = ..., model_limits: _Optional[_Iterable[_Union[ModelKeyLimits, _Mapping]]] = ..., weight: _Optional[int] = ..., priority: _Optional[int] = ..., expires_unix_ms: _Optional[int] = ..., previous_key_hash: _Optional[str] = ..., previous_expires_unix_ms: _Optional[int] = ...) -> None: ...

class KeyLimits(_message.Message):
    __slots__ = ("requests_per_minute", "input_tokens_per_minute", "output_tokens_per_minute", "token_budget", "budget_period", "max_concurrent")
    REQUESTS_PER_MINUTE_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKENS_PER_MINUTE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_PER_MINUTE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    BUDGET_PERIOD_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_FIELD_NUMBER: _ClassVar[int]
    requests_per_minute: int
    input_tokens_per_minute: int
    output_tokens_per_minute: int
    token_budget: int
    budget_period: BudgetPeriod
    max_concurrent: int
    def __init__(self, requests_per_minute: _Optional[int] = ..., input_tokens_per_minute: _Optional[int] = ..., output_tokens_per_minute: _Optional[int] = ..., token_budget: _Optional[int] = ..., budget_period: _Optional[_Union[BudgetPeriod, str]] = ..., max_concurrent: _Optional[int] = ...) -> None: ...

class ModelKeyLimits(_message.Message):
    __slots__ = ("model", "limits")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    model: str
    limits: KeyLimits
    def __init__(self, model: _Optional[str] = ..., limits: _Optional[_Union[KeyLimits, _Mapping]] = ...) -> None: ...

class FleetConfig(_message.Message):
    __slots__ = ("version", "models", "nodes", "api_keys", "revoked_token_ids", "retired_node_ids", "accepts_node_status", "edges", "expired_keys", "runtime_controls", "keys_required")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    API_KEYS_FIELD_NUMBER: _ClassVar[int]
    REVOKED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RETIRED_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_NODE_STATUS_FIELD_NUMBER: _ClassVar[int]
    EDGES_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_KEYS_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_CONTROLS_FIELD_NUMBER: _ClassVar[int]
    KEYS_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    version: int
    models: _containers.RepeatedCompositeFieldContainer[ModelConfig]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeConfig]
    api_keys: _containers.RepeatedCompositeFieldContainer[ApiKeyPolicy]
    revoked_token_ids: _containers.RepeatedScalarFieldContainer[str]
    retired_node_ids: _containers.RepeatedScalarFieldContainer[str]
    accepts_node_status: bool
    edges: _containers.RepeatedCompositeFieldContainer[EdgeEndpoint]
    expired_keys: _containers.RepeatedCompositeFieldContainer[ExpiredKey]
    runtime_controls: _containers.RepeatedCompositeFieldContainer[RuntimeControl]
    keys_required: bool
    def __init__(self, version: _Optional[int] = ..., models: _Optional[_Iterable[_Union[ModelConfig, _Mapping]]] = ..., nodes: _Optional[_Iterable[_Union[NodeConfig, _Mapping]]] = ..., api_keys: _Optional[_Iterable[_Union[ApiKeyPolicy, _Mapping]]] = ..., revoked_token_ids: _Optional[_Iterable[str]] = ..., retired_node_ids: _Optional[_Iterable[str]] = ..., accepts_node_status: _Optional[bool] = ..., edges: _Optional[_Iterable[_Union[EdgeEndpoint, _Mapping]]] = ..., expired_keys: _Optional[_Iterable[_Union[ExpiredKey, _Mapping]]] = ..., runtime_controls: _Optional[_Iterable[_Union[RuntimeControl, _Mapping]]] = ..., keys_required: _Optional[bool] = ...) -> None: ...

class RuntimeControl(_message.Message):
    __slots__ = ("kind", "target", "value", "change_id", "changed_by", "changed_unix_ms", "reason")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    CHANGE_ID_FIELD_NUMBER: _ClassVar[int]
    CHANGED_BY_FIELD_NUMBER: _ClassVar[int]
    CHANGED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    kind: str
    target: str
    value: str
    change_id: str
    changed_by: str
    changed_unix_ms: int
    reason: str
    def __init__(self, kind: _Optional[str] = ..., target: _Optional[str] = ..., value: _Optional[str] = ..., change_id: _Optional[str] = ..., changed_by: _Optional[str] = ..., changed_unix_ms: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class RuntimeControlChange(_message.Message):
    __slots__ = ("change_id", "at_unix_ms", "changed_by", "kind", "target", "before", "after", "reason", "reverts")
    CHANGE_ID_FIELD_NUMBER: _ClassVar[int]
    AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    CHANGED_BY_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    BEFORE_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REVERTS_FIELD_NUMBER: _ClassVar[int]
    change_id: str
    at_unix_ms: int
    changed_by: str
    kind: str
    target: str
    before: str
    after: str
    reason: str
    reverts: str
    def __init__(self, change_id: _Optional[str] = ..., at_unix_ms: _Optional[int] = ..., changed_by: _Optional[str] = ..., kind: _Optional[str] = ..., target: _Optional[str] = ..., before: _Optional[str] = ..., after: _Optional[str] = ..., reason: _Optional[str] = ..., reverts: _Optional[str] = ...) -> None: ...

class RuntimeControlRequest(_message.Message):
    __slots__ = ("changed_by", "kind", "target", "value", "reason", "revert_change_id", "list_only", "audit_limit")
    CHANGED_BY_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REVERT_CHANGE_ID_FIELD_NUMBER: _ClassVar[int]
    LIST_ONLY_FIELD_NUMBER: _ClassVar[int]
    AUDIT_LIMIT_FIELD_NUMBER: _ClassVar[int]
    changed_by: str
    kind: str
    target: str
    value: str
    reason: str
    revert_change_id: str
    list_only: bool
    audit_limit: int
    def __init__(self, changed_by: _Optional[str] = ..., kind: _Optional[str] = ..., target: _Optional[str] = ..., value: _Optional[str] = ..., reason: _Optional[str] = ..., revert_change_id: _Optional[str] = ..., list_only: _Optional[bool] = ..., audit_limit: _Optional[int] = ...) -> None: ...

class RuntimeControlResponse(_message.Message):
    __slots__ = ("error", "error_code", "change", "controls", "audit")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    CHANGE_FIELD_NUMBER: _ClassVar[int]
    CONTROLS_FIELD_NUMBER: _ClassVar[int]
    AUDIT_FIELD_NUMBER: _ClassVar[int]
    error: str
    error_code: str
    change: RuntimeControlChange
    controls: _containers.RepeatedCompositeFieldContainer[RuntimeControl]
    audit: _containers.RepeatedCompositeFieldContainer[RuntimeControlChange]
    def __init__(self, error: _Optional[str] = ..., error_code: _Optional[str] = ..., change: _Optional[_Union[RuntimeControlChange, _Mapping]] = ..., controls: _Optional[_Iterable[_Union[RuntimeControl, _Mapping]]] = ..., audit: _Optional[_Iterable[_Union[RuntimeControlChange, _Mapping]]] = ...) -> None: ...

class ExpiredKey(_message.Message):
    __slots__ = ("key_id", "key_hash", "expired_unix_ms")
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_HASH_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    key_hash: str
    expired_unix_ms: int
    def __init__(self, key_id: _Optional[str] = ..., key_hash: _Optional[str] = ..., expired_unix_ms: _Optional[int] = ...) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("node_id", "connected", "token_id", "since_unix_ms", "peer_address", "detail")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SINCE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    connected: bool
    token_id: str
    since_unix_ms: int
    peer_address: str
    detail: str
    def __init__(self, node_id: _Optional[str] = ..., connected: _Optional[bool] = ..., token_id: _Optional[str] = ..., since_unix_ms: _Optional[int] = ..., peer_address: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class NodeStatusReport(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStatus]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeStatus, _Mapping]]] = ...) -> None: ...

class AuthorizeNodeRequest(_message.Message):
    __slots__ = ("node_id", "token", "certificate_identity")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    token: str
    certificate_identity: str
    def __init__(self, node_id: _Optional[str] = ..., token: _Optional[str] = ..., certificate_identity: _Optional[str] = ...) -> None: ...

class AuthorizeNodeResponse(_message.Message):
    __slots__ = ("accepted", "reason", "node_config", "token_id", "reason_code")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NODE_CONFIG_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_CODE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    node_config: NodeConfig
    token_id: str
    reason_code: str
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., node_config: _Optional[_Union[NodeConfig, _Mapping]] = ..., token_id: _Optional[str] = ..., reason_code: _Optional[str] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class LeaseGrant(_message.Message):
    __slots__ = ("batch_id", "lease_id", "expires_at_unix_ms", "endpoint", "next_line", "total_lines")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    NEXT_LINE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_LINES_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    lease_id: str
    expires_at_unix_ms: int
    endpoint: str
    next_line: int
    total_lines: int
    def __init__(self, batch_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., expires_at_unix_ms: _Optional[int] = ..., endpoint: _Optional[str] = ..., next_line: _Optional[int] = ..., total_lines: _Optional[int] = ...) -> None: ...

class LeaseRenew(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class LeaseRelease(_message.Message):
    __slots__ = ("lease_id", "finished")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    finished: bool
    def __init__(self, lease_id: _Optional[str] = ..., finished: _Optional[bool] = ...) -> None: ...

class BatchLineRequest(_message.Message):
    __slots__ = ("lease_id", "line_number")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LINE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    line_number: int
    def __init__(self, lease_id: _Optional[str] = ..., line_number: _Optional[int] = ...) -> None: ...

class BatchLineResult(_message.Message):
    __slots__ = ("lease_id", "line_number", "custom_id", "status_code", "response_json", "error_json")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LINE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_JSON_FIELD_NUMBER: _ClassVar[int]
    ERROR_JSON_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    line_number: int
    custom_id: str
    status_code: int
    response_json: bytes
    error_json: bytes
    def __init__(self, lease_id: _Optional[str] = ..., line_number: _Optional[int] = ..., custom_id: _Optional[str] = ..., status_code: _Optional[int] = ..., response_json: _Optional[bytes] = ..., error_json: _Optional[bytes] = ...) -> None: ...
