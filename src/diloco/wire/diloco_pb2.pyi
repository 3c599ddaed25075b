from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("learner_id", "layout_hash", "num_fragments", "tensors", "observer", "tokens_per_step", "generation", "unsettled_from")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    OBSERVER_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    UNSETTLED_FROM_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    layout_hash: str
    num_fragments: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    observer: bool
    tokens_per_step: int
    generation: int
    unsettled_from: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, learner_id: _Optional[str] = ..., layout_hash: _Optional[str] = ..., num_fragments: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., observer: _Optional[bool] = ..., tokens_per_step: _Optional[int] = ..., generation: _Optional[int] = ..., unsettled_from: _Optional[_Iterable[int]] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("session", "versions", "lease_s", "heartbeat_s", "up_codec", "down_codec", "fragments", "syncer_id", "shard", "num_shards", "schedule", "sync_every", "committed_uploads", "logged_from", "lineage", "fates")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_S_FIELD_NUMBER: _ClassVar[int]
    UP_CODEC_FIELD_NUMBER: _ClassVar[int]
    DOWN_CODEC_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    SYNCER_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    SYNC_EVERY_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_UPLOADS_FIELD_NUMBER: _ClassVar[int]
    LOGGED_FROM_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    FATES_FIELD_NUMBER: _ClassVar[int]
    session: str
    versions: _containers.RepeatedScalarFieldContainer[int]
    lease_s: float
    heartbeat_s: float
    up_codec: str
    down_codec: str
    fragments: _containers.RepeatedScalarFieldContainer[int]
    syncer_id: str
    shard: int
    num_shards: int
    schedule: str
    sync_every: int
    committed_uploads: _containers.RepeatedScalarFieldContainer[int]
    logged_from: _containers.RepeatedScalarFieldContainer[int]
    lineage: str
    fates: UploadFates
    def __init__(self, session: _Optional[str] = ..., versions: _Optional[_Iterable[int]] = ..., lease_s: _Optional[float] = ..., heartbeat_s: _Optional[float] = ..., up_codec: _Optional[str] = ..., down_codec: _Optional[str] = ..., fragments: _Optional[_Iterable[int]] = ..., syncer_id: _Optional[str] = ..., shard: _Optional[int] = ..., num_shards: _Optional[int] = ..., schedule: _Optional[str] = ..., sync_every: _Optional[int] = ..., committed_uploads: _Optional[_Iterable[int]] = ..., logged_from: _Optional[_Iterable[int]] = ..., lineage: _Optional[str] = ..., fates: _Optional[_Union[UploadFates, _Mapping]] = ...) -> None: ...

class UploadFates(_message.Message):
    __slots__ = ("excluded", "open")
    EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    excluded: _containers.RepeatedScalarFieldContainer[int]
    open: _containers.RepeatedCompositeFieldContainer[OpenUpload]
    def __init__(self, excluded: _Optional[_Iterable[int]] = ..., open: _Optional[_Iterable[_Union[OpenUpload, _Mapping]]] = ...) -> None: ...

class OpenUpload(_message.Message):
    __slots__ = ("upload_id", "admitted")
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    upload_id: int
    admitted: int
    def __init__(self, upload_id: _Optional[int] = ..., admitted: _Optional[int] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("learner_id", "session", "have_versions", "have_digests")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    HAVE_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    HAVE_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    session: str
    have_versions: _containers.RepeatedScalarFieldContainer[int]
    have_digests: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, learner_id: _Optional[str] = ..., session: _Optional[str] = ..., have_versions: _Optional[_Iterable[int]] = ..., have_digests: _Optional[_Iterable[str]] = ...) -> None: ...

class FragmentChunk(_message.Message):
    __slots__ = ("fragment", "version", "codec", "numel", "chunk_index", "num_chunks", "data", "contributors", "is_delta", "base_version", "request", "unchanged", "dropped_uploads")
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    IS_DELTA_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    UNCHANGED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_UPLOADS_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    version: int
    codec: str
    numel: int
    chunk_index: int
    num_chunks: int
    data: bytes
    contributors: _containers.RepeatedScalarFieldContainer[str]
    is_delta: bool
    base_version: int
    request: bool
    unchanged: bool
    dropped_uploads: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, fragment: _Optional[int] = ..., version: _Optional[int] = ..., codec: _Optional[str] = ..., numel: _Optional[int] = ..., chunk_index: _Optional[int] = ..., num_chunks: _Optional[int] = ..., data: _Optional[bytes] = ..., contributors: _Optional[_Iterable[str]] = ..., is_delta: _Optional[bool] = ..., base_version: _Optional[int] = ..., request: _Optional[bool] = ..., unchanged: _Optional[bool] = ..., dropped_uploads: _Optional[_Iterable[int]] = ...) -> None: ...

class UploadChunk(_message.Message):
    __slots__ = ("learner_id", "session", "fragment", "base_version", "steps", "tokens", "codec", "numel", "chunk_index", "num_chunks", "data", "step_time_s", "final", "upload_id", "final_fragments", "resend")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    FINAL_FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    RESEND_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    session: str
    fragment: int
    base_version: int
    steps: int
    tokens: int
    codec: str
    numel: int
    chunk_index: int
    num_chunks: int
    data: bytes
    step_time_s: float
    final: bool
    upload_id: int
    final_fragments: _containers.RepeatedScalarFieldContainer[int]
    resend: bool
    def __init__(self, learner_id: _Optional[str] = ..., session: _Optional[str] = ..., fragment: _Optional[int] = ..., base_version: _Optional[int] = ..., steps: _Optional[int] = ..., tokens: _Optional[int] = ..., codec: _Optional[str] = ..., numel: _Optional[int] = ..., chunk_index: _Optional[int] = ..., num_chunks: _Optional[int] = ..., data: _Optional[bytes] = ..., step_time_s: _Optional[float] = ..., final: _Optional[bool] = ..., upload_id: _Optional[int] = ..., final_fragments: _Optional[_Iterable[int]] = ..., resend: _Optional[bool] = ...) -> None: ...

class UploadReply(_message.Message):
    __slots__ = ("accepted", "reason", "resync", "current_version", "fate_unknown")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    FATE_UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    resync: bool
    current_version: int
    fate_unknown: bool
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., resync: _Optional[bool] = ..., current_version: _Optional[int] = ..., fate_unknown: _Optional[bool] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("learner_id", "session", "step", "tokens", "steps_per_s", "state", "unsettled_from")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    UNSETTLED_FROM_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    session: str
    step: int
    tokens: int
    steps_per_s: float
    state: str
    unsettled_from: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, learner_id: _Optional[str] = ..., session: _Optional[str] = ..., step: _Optional[int] = ..., tokens: _Optional[int] = ..., steps_per_s: _Optional[float] = ..., state: _Optional[str] = ..., unsettled_from: _Optional[_Iterable[int]] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("known", "versions", "dropped_uploads")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_UPLOADS_FIELD_NUMBER: _ClassVar[int]
    known: bool
    versions: _containers.RepeatedScalarFieldContainer[int]
    dropped_uploads: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, known: _Optional[bool] = ..., versions: _Optional[_Iterable[int]] = ..., dropped_uploads: _Optional[_Iterable[int]] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("learner_id", "session")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    session: str
    def __init__(self, learner_id: _Optional[str] = ..., session: _Optional[str] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LearnerStatus(_message.Message):
    __slots__ = ("learner_id", "live", "step", "tokens", "steps_per_s", "state", "contributions", "bytes_up", "bytes_down", "connected", "finals_due")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_UP_FIELD_NUMBER: _ClassVar[int]
    BYTES_DOWN_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    FINALS_DUE_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    live: bool
    step: int
    tokens: int
    steps_per_s: float
    state: str
    contributions: int
    bytes_up: int
    bytes_down: int
    connected: bool
    finals_due: int
    def __init__(self, learner_id: _Optional[str] = ..., live: _Optional[bool] = ..., step: _Optional[int] = ..., tokens: _Optional[int] = ..., steps_per_s: _Optional[float] = ..., state: _Optional[str] = ..., contributions: _Optional[int] = ..., bytes_up: _Optional[int] = ..., bytes_down: _Optional[int] = ..., connected: _Optional[bool] = ..., finals_due: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("syncer_id", "versions", "rounds", "bytes_up", "bytes_down", "learners", "uptime_s", "refused", "fragments", "shard", "num_shards", "failure", "waiting", "merged_tokens")
    SYNCER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_UP_FIELD_NUMBER: _ClassVar[int]
    BYTES_DOWN_FIELD_NUMBER: _ClassVar[int]
    LEARNERS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    MERGED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    syncer_id: str
    versions: _containers.RepeatedScalarFieldContainer[int]
    rounds: int
    bytes_up: int
    bytes_down: int
    learners: _containers.RepeatedCompositeFieldContainer[LearnerStatus]
    uptime_s: float
    refused: int
    fragments: _containers.RepeatedScalarFieldContainer[int]
    shard: int
    num_shards: int
    failure: str
    waiting: int
    merged_tokens: int
    def __init__(self, syncer_id: _Optional[str] = ..., versions: _Optional[_Iterable[int]] = ..., rounds: _Optional[int] = ..., bytes_up: _Optional[int] = ..., bytes_down: _Optional[int] = ..., learners: _Optional[_Iterable[_Union[LearnerStatus, _Mapping]]] = ..., uptime_s: _Optional[float] = ..., refused: _Optional[int] = ..., fragments: _Optional[_Iterable[int]] = ..., shard: _Optional[int] = ..., num_shards: _Optional[int] = ..., failure: _Optional[str] = ..., waiting: _Optional[int] = ..., merged_tokens: _Optional[int] = ...) -> None: ...
