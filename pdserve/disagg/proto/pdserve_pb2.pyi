from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingConfig(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "has_seed", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "logit_bias", "guide_kind", "guide_spec")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    GUIDE_KIND_FIELD_NUMBER: _ClassVar[int]
    GUIDE_SPEC_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    has_seed: bool
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: bool
    top_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_tokens: int
    logit_bias: _containers.RepeatedCompositeFieldContainer[LogitBias]
    guide_kind: str
    guide_spec: str
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Iterable[_Union[LogitBias, _Mapping]]] = ..., guide_kind: _Optional[str] = ..., guide_spec: _Optional[str] = ...) -> None: ...

class LogitBias(_message.Message):
    __slots__ = ("token", "bias")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    BIAS_FIELD_NUMBER: _ClassVar[int]
    token: int
    bias: float
    def __init__(self, token: _Optional[int] = ..., bias: _Optional[float] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token", "logprob")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token: int
    logprob: float
    def __init__(self, token: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class ModelFingerprint(_message.Message):
    __slots__ = ("architecture", "num_layers", "num_kv_heads", "head_dim", "dtype", "block_size", "quantization", "transfer_backend", "kv_dtype", "block_bytes", "kv_layout", "rope", "tokenizer", "deterministic", "kv_checksum", "kernels")
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    ROPE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    DETERMINISTIC_FIELD_NUMBER: _ClassVar[int]
    KV_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    quantization: str
    transfer_backend: str
    kv_dtype: str
    block_bytes: int
    kv_layout: str
    rope: str
    tokenizer: str
    deterministic: bool
    kv_checksum: bool
    kernels: str
    def __init__(self, architecture: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., quantization: _Optional[str] = ..., transfer_backend: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., block_bytes: _Optional[int] = ..., kv_layout: _Optional[str] = ..., rope: _Optional[str] = ..., tokenizer: _Optional[str] = ..., deterministic: _Optional[bool] = ..., kv_checksum: _Optional[bool] = ..., kernels: _Optional[str] = ...) -> None: ...

class PeerInfoRequest(_message.Message):
    __slots__ = ("decode_transfer_address", "decode_transfer_metadata", "decode_transfer_backend")
    DECODE_TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TRANSFER_METADATA_FIELD_NUMBER: _ClassVar[int]
    DECODE_TRANSFER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    decode_transfer_address: str
    decode_transfer_metadata: bytes
    decode_transfer_backend: str
    def __init__(self, decode_transfer_address: _Optional[str] = ..., decode_transfer_metadata: _Optional[bytes] = ..., decode_transfer_backend: _Optional[str] = ...) -> None: ...

class KVRank(_message.Message):
    __slots__ = ("rank", "head_start", "head_count", "transfer_endpoint")
    RANK_FIELD_NUMBER: _ClassVar[int]
    HEAD_START_FIELD_NUMBER: _ClassVar[int]
    HEAD_COUNT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    rank: int
    head_start: int
    head_count: int
    transfer_endpoint: str
    def __init__(self, rank: _Optional[int] = ..., head_start: _Optional[int] = ..., head_count: _Optional[int] = ..., transfer_endpoint: _Optional[str] = ...) -> None: ...

class PeerInfo(_message.Message):
    __slots__ = ("tp_size", "fingerprint", "role", "transfer_metadata", "kv_ranks")
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_METADATA_FIELD_NUMBER: _ClassVar[int]
    KV_RANKS_FIELD_NUMBER: _ClassVar[int]
    tp_size: int
    fingerprint: ModelFingerprint
    role: str
    transfer_metadata: bytes
    kv_ranks: _containers.RepeatedCompositeFieldContainer[KVRank]
    def __init__(self, tp_size: _Optional[int] = ..., fingerprint: _Optional[_Union[ModelFingerprint, _Mapping]] = ..., role: _Optional[str] = ..., transfer_metadata: _Optional[bytes] = ..., kv_ranks: _Optional[_Iterable[_Union[KVRank, _Mapping]]] = ...) -> None: ...

class NixlPeer(_message.Message):
    __slots__ = ("agent_metadata", "layer_addresses", "num_blocks", "block_bytes", "shards")
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    LAYER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    agent_metadata: bytes
    layer_addresses: _containers.RepeatedScalarFieldContainer[int]
    num_blocks: int
    block_bytes: int
    shards: _containers.RepeatedCompositeFieldContainer[NixlShard]
    def __init__(self, agent_metadata: _Optional[bytes] = ..., layer_addresses: _Optional[_Iterable[int]] = ..., num_blocks: _Optional[int] = ..., block_bytes: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[NixlShard, _Mapping]]] = ...) -> None: ...

class NixlShard(_message.Message):
    __slots__ = ("head_start", "num_heads", "layer_addresses", "block_bytes")
    HEAD_START_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    LAYER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    head_start: int
    num_heads: int
    layer_addresses: _containers.RepeatedScalarFieldContainer[int]
    block_bytes: int
    def __init__(self, head_start: _Optional[int] = ..., num_heads: _Optional[int] = ..., layer_addresses: _Optional[_Iterable[int]] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class NixlFrame(_message.Message):
    __slots__ = ("header", "src_block_ids")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    header: TransferFrameHeader
    src_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, header: _Optional[_Union[TransferFrameHeader, _Mapping]] = ..., src_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class NixlAck(_message.Message):
    __slots__ = ("unique_key", "layer", "refused", "message", "head_start")
    UNIQUE_KEY_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    HEAD_START_FIELD_NUMBER: _ClassVar[int]
    unique_key: str
    layer: int
    refused: str
    message: str
    head_start: int
    def __init__(self, unique_key: _Optional[str] = ..., layer: _Optional[int] = ..., refused: _Optional[str] = ..., message: _Optional[str] = ..., head_start: _Optional[int] = ...) -> None: ...

class NixlAcks(_message.Message):
    __slots__ = ("acks",)
    ACKS_FIELD_NUMBER: _ClassVar[int]
    acks: _containers.RepeatedCompositeFieldContainer[NixlAck]
    def __init__(self, acks: _Optional[_Iterable[_Union[NixlAck, _Mapping]]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "unique_key", "token_ids", "sampling", "decode_transfer_address", "target_block_ids", "deadline_unix", "decode_kv_head_bounds", "cached_block_keys", "cache_salt", "migrate_handle")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    UNIQUE_KEY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TARGET_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    DECODE_KV_HEAD_BOUNDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    MIGRATE_HANDLE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    unique_key: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingConfig
    decode_transfer_address: str
    target_block_ids: _containers.RepeatedScalarFieldContainer[int]
    deadline_unix: float
    decode_kv_head_bounds: _containers.RepeatedScalarFieldContainer[int]
    cached_block_keys: _containers.RepeatedScalarFieldContainer[bytes]
    cache_salt: str
    migrate_handle: str
    def __init__(self, request_id: _Optional[str] = ..., unique_key: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingConfig, _Mapping]] = ..., decode_transfer_address: _Optional[str] = ..., target_block_ids: _Optional[_Iterable[int]] = ..., deadline_unix: _Optional[float] = ..., decode_kv_head_bounds: _Optional[_Iterable[int]] = ..., cached_block_keys: _Optional[_Iterable[bytes]] = ..., cache_salt: _Optional[str] = ..., migrate_handle: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("has_first_token", "first_token", "first_logprob", "num_skipped_blocks", "num_prefill_cached_tokens", "bytes_sent", "prefill_started_unix", "last_layer_sent_unix", "prefill_scheduled_unix", "prefill_computed_unix", "first_top")
    HAS_FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NUM_SKIPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILL_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_STARTED_UNIX_FIELD_NUMBER: _ClassVar[int]
    LAST_LAYER_SENT_UNIX_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SCHEDULED_UNIX_FIELD_NUMBER: _ClassVar[int]
    PREFILL_COMPUTED_UNIX_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOP_FIELD_NUMBER: _ClassVar[int]
    has_first_token: bool
    first_token: int
    first_logprob: float
    num_skipped_blocks: int
    num_prefill_cached_tokens: int
    bytes_sent: int
    prefill_started_unix: float
    last_layer_sent_unix: float
    prefill_scheduled_unix: float
    prefill_computed_unix: float
    first_top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, has_first_token: _Optional[bool] = ..., first_token: _Optional[int] = ..., first_logprob: _Optional[float] = ..., num_skipped_blocks: _Optional[int] = ..., num_prefill_cached_tokens: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., prefill_started_unix: _Optional[float] = ..., last_layer_sent_unix: _Optional[float] = ..., prefill_scheduled_unix: _Optional[float] = ..., prefill_computed_unix: _Optional[float] = ..., first_top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeStats(_message.Message):
    __slots__ = ("num_blocks", "num_free_blocks", "num_requests", "resource_store_entries", "side_channel_entries", "tombstones", "pending_tasks", "frames_rejected", "bytes_received", "bytes_sent", "not_split", "held_for_send", "transfer_links_opened", "threads", "transfer_connections", "grpc_unauthenticated", "kv_checksum_failures")
    class TransferConnectionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RESOURCE_STORE_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    SIDE_CHANNEL_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    TOMBSTONES_FIELD_NUMBER: _ClassVar[int]
    PENDING_TASKS_FIELD_NUMBER: _ClassVar[int]
    FRAMES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    NOT_SPLIT_FIELD_NUMBER: _ClassVar[int]
    HELD_FOR_SEND_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_LINKS_OPENED_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    GRPC_UNAUTHENTICATED_FIELD_NUMBER: _ClassVar[int]
    KV_CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    num_free_blocks: int
    num_requests: int
    resource_store_entries: int
    side_channel_entries: int
    tombstones: int
    pending_tasks: int
    frames_rejected: int
    bytes_received: int
    bytes_sent: int
    not_split: int
    held_for_send: int
    transfer_links_opened: int
    threads: int
    transfer_connections: _containers.ScalarMap[str, int]
    grpc_unauthenticated: int
    kv_checksum_failures: int
    def __init__(self, num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_requests: _Optional[int] = ..., resource_store_entries: _Optional[int] = ..., side_channel_entries: _Optional[int] = ..., tombstones: _Optional[int] = ..., pending_tasks: _Optional[int] = ..., frames_rejected: _Optional[int] = ..., bytes_received: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., not_split: _Optional[int] = ..., held_for_send: _Optional[int] = ..., transfer_links_opened: _Optional[int] = ..., threads: _Optional[int] = ..., transfer_connections: _Optional[_Mapping[str, int]] = ..., grpc_unauthenticated: _Optional[int] = ..., kv_checksum_failures: _Optional[int] = ...) -> None: ...

class KVEventsRequest(_message.Message):
    __slots__ = ("since", "epoch")
    SINCE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    since: int
    epoch: str
    def __init__(self, since: _Optional[int] = ..., epoch: _Optional[str] = ...) -> None: ...

class KVEvents(_message.Message):
    __slots__ = ("epoch", "seq", "reset", "stored", "removed")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    seq: int
    reset: bool
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, epoch: _Optional[str] = ..., seq: _Optional[int] = ..., reset: _Optional[bool] = ..., stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "token_ids", "sampling", "timeout_s", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingConfig
    timeout_s: float
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingConfig, _Mapping]] = ..., timeout_s: _Optional[float] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finished", "finish_reason", "logprobs", "remote_prefill", "num_cached_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PREFILL_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finished: bool
    finish_reason: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    remote_prefill: bool
    num_cached_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ..., remote_prefill: _Optional[bool] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class TransferFrameHeader(_message.Message):
    __slots__ = ("kind", "unique_key", "layer", "block_ids", "head_start", "head_count", "block_bytes", "error", "reason", "stage", "layer_count", "layer_checksums")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        DATA: _ClassVar[TransferFrameHeader.Kind]
        FAILURE: _ClassVar[TransferFrameHeader.Kind]
    DATA: TransferFrameHeader.Kind
    FAILURE: TransferFrameHeader.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    UNIQUE_KEY_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    HEAD_START_FIELD_NUMBER: _ClassVar[int]
    HEAD_COUNT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    LAYER_COUNT_FIELD_NUMBER: _ClassVar[int]
    LAYER_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    kind: TransferFrameHeader.Kind
    unique_key: str
    layer: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    head_start: int
    head_count: int
    block_bytes: int
    error: str
    reason: str
    stage: str
    layer_count: int
    layer_checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kind: _Optional[_Union[TransferFrameHeader.Kind, str]] = ..., unique_key: _Optional[str] = ..., layer: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., head_start: _Optional[int] = ..., head_count: _Optional[int] = ..., block_bytes: _Optional[int] = ..., error: _Optional[str] = ..., reason: _Optional[str] = ..., stage: _Optional[str] = ..., layer_count: _Optional[int] = ..., layer_checksums: _Optional[_Iterable[int]] = ...) -> None: ...
