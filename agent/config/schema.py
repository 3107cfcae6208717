"""The configuration's schema: one pydantic model per TOML section, with its defaults, bounds
and the checks that span keys (a source's kind and its keys, unique source names).

Every section forbids unknown keys and is frozen: a typo is an error that names the key (see
agent.config.loading), and a loaded configuration is never changed in place.
"""

from __future__ import annotations

import importlib.util
import re
import socket
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from agent.protocol.topics import ReplyTopics, topic_prefix_problem, topic_problem


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class QosConfig(_Section):
    """QoS per message class; a request's own `qos` overrides `reply`."""

    reply: Literal[0, 1, 2] = 1
    event: Literal[0, 1, 2] = 1
    status: Literal[0, 1, 2] = 1
    telemetry: Literal[0, 1, 2] = 0
    request_subscription: Literal[0, 1, 2] = 1


class TlsConfig(_Section):
    enabled: bool = False
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None  # a secret: masked when printed
    check_hostname: bool = True


class MqttConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(default=1883, ge=1, le=65535)
    protocol: Literal["5", "3.1.1"] = "5"
    topic_prefix: str = "edge"
    client_id: str = ""  # default: "edge-agent-{device_id}"
    keepalive_s: int = Field(default=30, ge=5, le=3600)
    username: str | None = None
    password_file: Path | None = None  # read at connect time, never printed
    session_expiry_s: int = Field(default=3600, ge=0)
    reconnect_min_s: float = Field(default=0.5, gt=0)
    reconnect_max_s: float = Field(default=30.0, gt=0)
    max_inflight: int = Field(default=64, ge=1, le=65535)
    # MQTT 3.1.1 only (MQTT 5 brokers announce Receive Maximum): QoS 2 publishes left unfinished
    # at a time. Mosquitto keeps at most `max_inflight_messages` (default 20) and drops, with a
    # success PUBREC, any QoS 1/2 publish past them; decision 0024.
    max_inflight_qos2: int = Field(default=20, ge=1, le=65535)
    ack_timeout_s: float = Field(default=30.0, ge=0)  # unacknowledged this long: reconnect
    # The largest packet the broker takes (0: no limit of ours). MQTT 5 brokers announce it
    # in CONNACK (the smaller one counts); 3.1.1 brokers cannot: AWS IoT Core 131072, Azure
    # IoT Hub 262144, Mosquitto its max_packet_size.
    max_packet_bytes: int = Field(default=0, ge=0, le=268_435_460)
    # A broker acknowledges before it saves: after a lost connection (it may have crashed),
    # what it acknowledged in this many seconds before is published again (duplicates are
    # dropped by (id, seq)). Cover the broker's save interval (Mosquitto: autosave_interval).
    replay_after_reconnect_s: float = Field(default=5.0, ge=0)
    # Where a request's reply_to may point. Empty: the device's own result tree only
    # ("{topic_prefix}/{device_id}/result/"); anything wider is the operator's explicit choice.
    allowed_reply_prefixes: list[str] = Field(default_factory=list)
    tcp_nodelay: bool = True
    qos: QosConfig = QosConfig()
    tls: TlsConfig = TlsConfig()

    @model_validator(mode="after")
    def _backoff_in_order(self) -> MqttConfig:
        if self.reconnect_max_s < self.reconnect_min_s:
            raise ValueError("reconnect_max_s must be >= reconnect_min_s")
        return self

    @field_validator("topic_prefix")
    @classmethod
    def _topic_prefix_is_plain(cls, value: str) -> str:
        if not value or value.startswith("/"):
            raise ValueError("must be a non-empty topic level without a leading '/'")
        problem = topic_prefix_problem(value, "topic_prefix")
        if problem is not None:
            raise ValueError(problem)
        return value.rstrip("/")

    @field_validator("allowed_reply_prefixes")
    @classmethod
    def _reply_prefixes_are_topics(cls, value: list[str]) -> list[str]:
        for prefix in value:
            problem = topic_prefix_problem(prefix, "allowed reply prefix")
            if problem is not None:
                raise ValueError(problem)
        return value


class TrustConfig(_Section):
    """`[models.trust]`: who may put a model version on the box (agent.models.trust).

    With `require_signature`, a version serves only if its `model.sig` (OpenSSF model-signing,
    over the version folder's files) verifies offline against one of `public_keys` (PEM,
    elliptic-curve P-256/P-384/P-521) or chains to `certificate_chain` (PEM CA certificates).
    The files are checked readable when the configuration loads (agent.config.loading).
    """

    require_signature: bool = False
    public_keys: list[Path] = Field(default_factory=list)
    certificate_chain: list[Path] = Field(default_factory=list)

    @model_validator(mode="after")
    def _some_trust(self) -> TrustConfig:
        if self.require_signature and not (self.public_keys or self.certificate_chain):
            raise ValueError("require_signature needs public_keys or certificate_chain")
        return self

    def file_problems(self) -> list[str]:
        """Unreadable trust files and a missing library, checked after the paths are resolved:
        otherwise every version would fail at its first load, far from the cause."""
        problems = [
            problem
            for key in ("public_keys", "certificate_chain")
            for path in getattr(self, key)
            if (problem := _pem_problem(path, f"models.trust.{key}")) is not None
        ]
        if self.require_signature and importlib.util.find_spec("model_signing") is None:
            problems.append(
                "models.trust.require_signature: needs the model-signing package "
                "(pip install 'edge-stream-agent[signing]')"
            )
        return problems


def _pem_problem(path: Path, key: str) -> str | None:
    try:
        with path.open("rb") as f:
            head = f.read(64 * 1024)
    except OSError as e:
        return f"{key}: cannot read {path}: {e.strerror or e}"
    return None if b"-----BEGIN " in head else f"{key}: {path} is not a PEM file"


class ModelsConfig(_Section):
    repository: Path = Path("models")
    providers: list[str] = Field(
        default_factory=lambda: ["CPUExecutionProvider"],
        description="ONNX Runtime execution providers in order of preference",
    )
    intra_op_threads: int = Field(default=0, ge=0)  # 0: cores // workers
    warmup: bool = True
    # Backend-specific settings for every model (a model's config.toml may override them):
    # gpu = {engine_cache_path, timing_cache, fp16, workspace_bytes, device_id} for ONNX
    # Runtime's TensorRT/CUDA providers, provider_options = {Provider = {key = value}},
    # tensorrt = {device, zero_copy, activation_memory, build} for serialized engines.
    backend_options: dict[str, dict[str, Any]] = Field(default_factory=dict)
    # Hot swap: how new versions are noticed and when their files count as complete.
    watch: Literal["auto", "inotify", "poll", "off"] = "auto"
    settle_s: float = Field(default=1.0, ge=0)  # files written in place: unchanged this long
    debounce_s: float = Field(default=0.2, ge=0)
    poll_interval_s: float = Field(default=1.0, gt=0)  # the polling observer's period
    rescan_s: float = Field(default=30.0, gt=0)  # full rescan, the backstop for lost events
    drain_timeout_s: float = Field(default=30.0, ge=0)  # a replaced version's leases
    trust: TrustConfig = TrustConfig()  # signed versions; off by default


class SchedulerConfig(_Section):
    workers: int = Field(default=2, ge=1, le=64)
    queue_size: int = Field(default=256, ge=1)
    drain_timeout_s: float = Field(default=10.0, ge=0)
    # A request whose model's recent requests took at most this long runs on the network
    # thread when nothing is queued (no hand-off to a worker); 0: every request goes to one.
    inline_max_ms: float = Field(default=1.0, ge=0, le=50)


class LimitsConfig(_Section):
    """Limits on outside input, applied before decoding (see agent.protocol.errors.Limits)."""

    max_payload_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    max_decompressed_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    max_depth: int = Field(default=8, ge=2, le=64)
    max_map_keys: int = Field(default=64, ge=4)
    max_tensor_elements: int = Field(default=16 * 1024 * 1024, ge=1)
    max_tensor_bytes: int = Field(default=64 * 1024 * 1024, ge=1)
    max_rank: int = Field(default=8, ge=1)
    max_tensors: int = Field(default=32, ge=1)
    max_items: int = Field(default=65536, ge=16)  # CBOR items in one payload (arrays, maps, ...)
    # Pixels of a JPEG/PNG request input, read from its header before it is decoded.
    max_image_pixels: int = Field(default=40_000_000, ge=1)
    # Every reply message stays under 128 KB, the AWS IoT Core limit, with room for headers.
    max_chunk_bytes: int = Field(default=120 * 1024, ge=1024, le=256 * 1024 * 1024)
    # Payload bytes of one request's chunk/result messages; past it the stream ends with
    # `too_large`. 64 MiB: 16 times the largest request, the size of the outbox's memory
    # (outbox.max_bytes) and a quarter of the spool, so one request cannot fill either.
    max_reply_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)


class OutboxConfig(_Section):
    max_messages: int = Field(default=4096, ge=16)
    error_reserve: int = Field(default=1024, ge=0)  # room kept for error replies from ingress
    max_bytes: int = Field(default=64 * 1024 * 1024, ge=0)  # payload bytes queued in memory


class SpoolConfig(_Section):
    """The on-disk store of QoS 1/2 messages and requests (see agent.delivery.spool)."""

    enabled: bool = True
    path: Path | None = None  # default: {state_dir}/spool.sqlite
    max_bytes: int = Field(default=256 * 1024 * 1024, ge=64 * 1024)
    max_messages: int = Field(default=1_000_000, ge=16)
    # When full: "reject_new" blocks the workers (back pressure: the queue fills, new requests
    # get `overloaded`); "drop_oldest" evicts whole streams, oldest first, with an event.
    policy: Literal["reject_new", "drop_oldest"] = "reject_new"
    ttl_s: float = Field(default=0.0, ge=0)  # 0: messages never expire


class ResendConfig(_Section):
    """Application-level resend (`ROOT/resend`) from the spool's acknowledged history."""

    enabled: bool = True
    window_s: float = Field(default=600.0, ge=0)  # how long a stream's messages stay held
    max_bytes: int = Field(default=64 * 1024 * 1024, ge=0)  # history on disk, oldest dropped
    requests_per_s: float = Field(default=100.0, gt=0)  # token bucket; excess is dropped
    messages_per_s: float = Field(default=2000.0, gt=0)
    bytes_per_s: float = Field(default=4 * 1024 * 1024, gt=0)  # resent payload bytes a second
    max_queued_bytes: int = Field(default=8 * 1024 * 1024, ge=0)  # resends queued, not yet sent


class TelemetryConfig(_Section):
    interval_s: float = Field(default=30.0, ge=0)  # 0 disables the telemetry topic
    # Box telemetry (agent.ops.box): power rails, temperatures, GPU, memory, sampled this
    # often (0: no sampler, no `box` key, no energy per inference); a restart applies both.
    box_interval_s: float = Field(default=1.0, ge=0)
    box_root: Path = Path("/")  # where the host's /sys, /proc, /etc and /var are (containers)


class MetricsConfig(_Section):
    """The Prometheus endpoint (`/metrics`, `/healthz`); see agent.ops.endpoint."""

    enabled: bool = True
    host: str = "127.0.0.1"  # loopback: expose it on purpose, never by default
    port: int = Field(default=9842, ge=0, le=65535)  # 0: any free port (tests)


class SystemdConfig(_Section):
    """sd_notify (READY, STATUS, WATCHDOG, STOPPING) when $NOTIFY_SOCKET is set."""

    notify: bool = True
    # A worker running one job longer than this counts as stuck: watchdog pings stop.
    stuck_after_s: float = Field(default=120.0, gt=0)


SOURCE_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}\Z")  # a topic level and a file name
SOURCE_KINDS = ("video", "folder", "pipe", "synthetic", "pcm")
# Keys that only mean something for some kinds: set for another kind, they are an error.
SOURCE_KEYS_BY_KIND = {
    "path": ("video", "folder", "pipe", "pcm"),
    "url": ("video",),
    "device": ("video",),
    "backend": ("video",),
    "loop": ("video",),
    "settle_s": ("folder",),
    "poll_interval_s": ("folder",),
    "fill": ("synthetic",),
    "frame_shape": ("synthetic",),
    "max_record_bytes": ("pipe",),
    "command": ("pcm",),
    "format": ("pcm",),
    "sample_rate": ("pcm",),
    "channels": ("pcm",),
    "windows_per_chunk": ("pcm",),
    "window": ("pcm",),
    "hop": ("pcm",),
    "params": ("pcm",),
    "previous_text": ("pcm",),
    "silence_dbfs": ("pcm",),
}
SOURCE_KIND_DEFAULTS: dict[str, dict[str, Any]] = {
    "video": {"backend": "auto", "loop": False},
    "folder": {"settle_s": 0.5, "poll_interval_s": 0.5},
    "synthetic": {"fill": "zeros"},
    "pcm": {"format": "s16le", "channels": 1},
}


class SourceConfig(_Section):
    """One `[[sources]]` entry: a local source whose frames run through a model (agent.sources).

    Results stream on `ROOT/stream/{name}`. `inputs` maps model inputs to the source's fields
    (`frame` for video frames, images and .npy files; the keys of .npz files and pipe records);
    empty: a lone `frame` feeds the model's `[preprocess] input` or its only input.
    """

    name: str
    kind: Literal["video", "folder", "pipe", "synthetic", "pcm"]
    model: str = Field(min_length=1, max_length=64)
    enabled: bool = True
    inputs: dict[str, str] = Field(default_factory=dict)
    outputs: list[str] | None = None  # default: the model's `[stream] emit`, else all
    preprocess: bool = True  # false: the data already fits the model (skip [preprocess])
    # latest: keep only the newest frame waiting (older ones are dropped and counted);
    # all: queue up to `queue` frames, then the source waits (a pcm record counts as its
    # chunks, and goes in whole). Default: latest for cameras, URLs and synthetic, all for
    # video files, folder, pipe and pcm (folder and pcm must be all).
    policy: Literal["latest", "all"] | None = None
    queue: int = Field(default=8, ge=1, le=4096)
    priority: int = Field(default=2, ge=0, le=9)  # requests default to 4: they go first
    qos: Literal[0, 1, 2] | None = None  # default: [mqtt.qos] reply
    rate_hz: float | None = Field(default=None, gt=0, le=10000)  # synthetic: required
    max_frames: int | None = Field(default=None, ge=1)  # stop after this many frames
    path: Path | None = None  # video file, folder, FIFO or file ("-": standard input)
    url: str | None = Field(default=None, min_length=1)  # RTSP/HTTP URL, GStreamer pipeline
    device: int | None = Field(default=None, ge=0)  # V4L2 camera index (/dev/videoN)
    # Keys of one kind stay unset (None) for the others, so check-config prints only keys
    # that apply; SOURCE_KIND_DEFAULTS fills them in for their kind.
    backend: Literal["auto", "ffmpeg", "gstreamer", "v4l2"] | None = None  # video: auto
    loop: bool | None = None  # video: false; true starts a file again at its end
    settle_s: float | None = Field(default=None, ge=0)  # folder: unchanged this long = complete
    poll_interval_s: float | None = Field(default=None, gt=0)  # folder: 0.5
    fill: Literal["zeros", "random"] | None = None  # synthetic: zeros
    frame_shape: list[int] | None = None  # synthetic: uint8 frames of this shape (preprocessed)
    max_record_bytes: int | None = Field(default=None, ge=64)  # default: [limits] max_payload
    # pcm: raw interleaved samples from a command's stdout, or from `path` (a FIFO or a file).
    command: list[str] | None = Field(default=None, min_length=1)
    format: Literal["s16le", "f32le"] | None = None  # pcm: s16le
    sample_rate: int | None = Field(default=None, ge=1, le=1_000_000)  # pcm: required
    channels: int | None = Field(default=None, ge=1, le=64)  # pcm: 1 (channels feed the batch)
    windows_per_chunk: int | None = Field(default=None, ge=1, le=4096)  # pcm: the model's [scan]
    # pcm into a speech recogniser (a generate model reading a recording, as Whisper): the
    # samples a window takes and advances (default: the window), every window's generate
    # params, and whether a window reads the text of the one before (default: true)
    window: int | None = Field(default=None, ge=1)
    hop: int | None = Field(default=None, ge=1)
    params: dict[str, str | int | float] | None = None
    previous_text: bool | None = None
    silence_dbfs: float | None = Field(default=None, ge=-120, le=0)  # quieter windows: not run
    seq_reserve: int = Field(default=1000, ge=1, le=1_000_000)  # see docs/protocol.md
    retry_min_s: float = Field(default=1.0, gt=0)
    retry_max_s: float = Field(default=30.0, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _kind_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("kind"), str):
            return data
        kind = data["kind"]
        data = {**SOURCE_KIND_DEFAULTS.get(kind, {}), **data}
        if data.get("policy") is None:
            # Live sources keep the newest frame; a file, a folder or a pipe loses nothing.
            live_video = kind == "video" and data.get("path") is None
            latest = live_video or kind == "synthetic"
            data["policy"] = "latest" if latest else "all"
        return data

    @field_validator("name")
    @classmethod
    def _name_is_a_topic_level(cls, value: str) -> str:
        if not SOURCE_NAME.match(value):
            raise ValueError("must be 1-64 of A-Z a-z 0-9 . _ - (not starting with '.')")
        return value

    @field_validator("frame_shape")
    @classmethod
    def _frame_shape(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and not (len(value) in (2, 3) and all(0 < v <= 16384 for v in value)):
            raise ValueError("must be [height, width] or [height, width, channels], each 1..16384")
        return value

    @model_validator(mode="after")
    def _kind_keys(self) -> SourceConfig:
        wrong = [
            key
            for key, kinds in SOURCE_KEYS_BY_KIND.items()
            if getattr(self, key) is not None and self.kind not in kinds
        ]
        if wrong:
            raise ValueError(f'{", ".join(wrong)}: not for kind = "{self.kind}"')
        where = [k for k in ("path", "url", "device") if getattr(self, k) is not None]
        if self.kind == "video" and len(where) != 1:
            raise ValueError('kind = "video" needs exactly one of path, url, device')
        if self.kind in ("folder", "pipe") and self.path is None:
            raise ValueError(f'kind = "{self.kind}" needs path')
        if self.kind == "pcm":
            self._pcm_keys()
        if self.kind == "synthetic" and self.rate_hz is None:
            raise ValueError('kind = "synthetic" needs rate_hz')
        if self.kind == "folder" and self.policy == "latest":
            raise ValueError('kind = "folder" processes every file: policy must be "all"')
        if self.retry_max_s < self.retry_min_s:
            raise ValueError("retry_max_s must be >= retry_min_s")
        return self

    def _pcm_keys(self) -> None:
        """A pcm source reads one place, at a known rate, and every window in order: its
        state runs through them, so none may be dropped (`policy = "all"`)."""
        if (self.command is None) == (self.path is None):
            raise ValueError('kind = "pcm" needs exactly one of command, path')
        if self.command is not None and not all(self.command):
            raise ValueError("command: the program and its arguments must be non-empty")
        if self.sample_rate is None:
            raise ValueError('kind = "pcm" needs sample_rate')
        if self.policy == "latest":
            raise ValueError('kind = "pcm" runs every window in order: policy must be "all"')


class AgentConfig(_Section):
    device_id: str = Field(default_factory=socket.gethostname)
    state_dir: Path = Path("var")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["text", "json"] = "text"
    mqtt: MqttConfig = MqttConfig()
    models: ModelsConfig = ModelsConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    limits: LimitsConfig = LimitsConfig()
    outbox: OutboxConfig = OutboxConfig()
    spool: SpoolConfig = SpoolConfig()
    resend: ResendConfig = ResendConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    metrics: MetricsConfig = MetricsConfig()
    systemd: SystemdConfig = SystemdConfig()
    sources: list[SourceConfig] = Field(default_factory=list)  # [[sources]], see agent.sources

    @field_validator("sources")
    @classmethod
    def _unique_source_names(cls, value: list[SourceConfig]) -> list[SourceConfig]:
        names = [source.name for source in value]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"source name(s) used twice: {', '.join(twice)}")
        return value

    @field_validator("device_id")
    @classmethod
    def _device_id_is_a_topic_level(cls, value: str) -> str:
        problem = topic_problem(value, "device_id")
        if len(value) > 64 or any(c in value for c in "/ ") or problem is not None:
            raise ValueError(
                "must be 1-64 characters without '/', '+', '#', spaces or control characters"
            )
        return value

    @property
    def root_topic(self) -> str:
        return f"{self.mqtt.topic_prefix}/{self.device_id}"

    @property
    def reply_topics(self) -> ReplyTopics:
        """Where replies may go: the allowed prefixes (default: this device's result tree),
        never the agent's own other topics."""
        root = self.root_topic
        prefixes = self.mqtt.allowed_reply_prefixes or ReplyTopics.default_prefixes(root)
        return ReplyTopics.of(prefixes, root)

    @property
    def client_id(self) -> str:
        return self.mqtt.client_id or f"edge-agent-{self.device_id}"
