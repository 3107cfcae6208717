"""What the model manager keeps per model and version, and what it hands out.

The records (:class:`ModelRecord`, :class:`VersionRecord`, :class:`LoadedVersion`) are
owned by :class:`agent.models.manager.ModelManager` and changed only under its lock; the
rest of the agent sees them through a :class:`Lease` (one request's hold on a version), a
:class:`Serving` (what ingress checks a request against) and the inventory payload
(:func:`inventory_of`; :func:`summarize` and :func:`format_inventory` for logs and the CLI).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal

import cbor2

from agent.models.audio_inputs import AUDIO_INPUT, AudioNormalization
from agent.models.backends.base import (
    Dim,
    Session,
    TensorSpec,
    session_device_bytes,
    session_metadata,
)
from agent.models.decoder_layout import Generation
from agent.models.encoders import FEATURES, PIXELS
from agent.models.model_config import BatchingConfig, ModelConfig, StreamConfig
from agent.models.postprocess import Postprocessor
from agent.models.preprocess import PreprocessConfig, image_input
from agent.models.signature import request_inputs
from agent.models.text_inputs import TEXT_INPUT, TextInputs

__all__ = [
    "INVENTORY_DETAIL_BYTES",
    "VERSION_DETAIL_FLOOR",
    "Event",
    "Fingerprint",
    "Lease",
    "LoadedVersion",
    "ModelRecord",
    "Serving",
    "State",
    "VersionDetails",
    "VersionRecord",
    "format_inventory",
    "inventory_of",
    "loaded_versions",
    "summarize",
]

State = Literal["building", "loading", "ready", "failed", "draining", "unloaded"]
Fingerprint = tuple[int, int]
Event = dict[str, Any]


@dataclass
class LoadedVersion:
    """A ready session plus what requests need to run it."""

    model: str
    version: int
    session: Session
    config: ModelConfig
    backend: str
    leases: int = 0
    retired: bool = False
    retired_at: float = 0.0
    closed: bool = False
    # Its signature and metadata for the inventory, sized once (by `inventory_of`, lazily).
    details: VersionDetails | None = field(default=None, repr=False, compare=False)
    postprocess: Postprocessor | None = field(default=None, repr=False, compare=False)
    generation: Generation | None = field(default=None, repr=False, compare=False)  # generate
    text: TextInputs | None = field(default=None, repr=False, compare=False)  # text in
    audio: AudioNormalization | None = field(default=None, repr=False, compare=False)
    # The `[preprocess]` its image processor's `preprocessor_config.json` describes, where
    # `config.toml` has none (agent.models.image_processor).
    processor_preprocess: PreprocessConfig | None = field(default=None, repr=False, compare=False)

    @property
    def preprocess(self) -> PreprocessConfig | None:
        """How an image becomes its input: `config.toml`'s `[preprocess]`, else its image
        processor's."""
        return self.config.preprocess or self.processor_preprocess

    def close_sessions(self) -> None:
        """Frees the version's sessions: its model's, and an encoder-decoder's encoder."""
        try:
            self.session.close()
        finally:
            if self.generation is not None:
                self.generation.close()

    @functools.cached_property
    def request_inputs(self) -> tuple[TensorSpec, ...]:
        """What a request's inputs are checked against (`agent.models.signature.request_inputs`:
        a scan's recording may be of any length)."""
        return request_inputs(self.session.inputs, self.config)


@dataclass
class VersionRecord:
    """What the inventory says about one version folder."""

    state: State
    backend: str | None
    error: str | None = None
    fingerprint: Fingerprint | None = None
    # Files found changed under the loaded version (replaced in place): warned once each.
    changed_files: Fingerprint | None = None
    loaded: LoadedVersion | None = None
    removed: bool = False  # the folder is gone: forget the entry once it is closed
    warmup: str | None = None  # "ok", "off" or "skipped: <reason>" (the inventory's `warmup`)
    signed: dict[str, str] | None = None  # {"by": key or identity}: model.sig verified
    # While `building`: its TensorRT engine build's progress (agent.models.engine_builds).
    progress: Callable[[], dict[str, Any]] | None = None


@dataclass
class ModelRecord:
    """One model folder: its config, the version that serves, and every version's record."""

    name: str
    config: ModelConfig = field(default_factory=ModelConfig)
    serving: LoadedVersion | None = None
    versions: dict[int, VersionRecord] = field(default_factory=dict)
    # the version that served until it was removed with none loaded to take over: the
    # `from` of the `model_swapped` when the next one serves
    served_before: int | None = None


@dataclass(frozen=True)
class Serving:
    """What ingress checks a request against: the serving version's inputs and the model's
    stream and batching settings (one read, no lock, for every request)."""

    version: int
    inputs: Sequence[TensorSpec]
    stream: StreamConfig
    batching: BatchingConfig | None  # None: off
    defaults: tuple[str, ...] = ()  # inputs `[defaults]` gives: a request may leave them out
    image_input: str | None = None  # the `[preprocess]` input: may come as a JPEG/PNG
    takes_text: bool = False  # a tokenizer makes its token inputs: `prompt` may come instead
    token_ids: str | None = None  # the input of token ids a tokenizer makes (never negative)
    # a generate version's: its params are checked at arrival
    generation: Generation | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, loaded: LoadedVersion, config: ModelConfig) -> Serving:
        """What ingress needs of `loaded`, served under `config`."""
        batching = config.batching
        return cls(
            loaded.version,
            loaded.request_inputs,
            config.stream,
            batching if batching.enabled else None,
            tuple(config.defaults),
            image_input(loaded.preprocess, loaded.session.inputs),
            loaded.text is not None,
            loaded.text.ids.name if loaded.text is not None else None,
            loaded.generation,
        )


class Lease:
    """Holds one version open for the length of a request (a context manager)."""

    def __init__(self, release: Callable[[LoadedVersion], None], loaded: LoadedVersion) -> None:
        self._release_version = release
        self.loaded = loaded
        self._released = False

    @property
    def session(self) -> Session:
        return self.loaded.session

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._release_version(self.loaded)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


# The inventory is retained on MQTT, so it must fit one message: 128 KB at AWS IoT Core (and
# at `mqtt.max_packet_bytes` = 131072). Signatures and metadata share this many bytes, split
# evenly over the ready versions, each getting at least the floor; what does not fit is
# counted, not listed (docs/protocol.md, Inventory; benchmarks/inventory_size.py).
INVENTORY_DETAIL_BYTES = 96 * 1024
VERSION_DETAIL_FLOOR = 256
_OVERHEAD = 64  # map heads and the keys signature/inputs/outputs/omitted/metadata/props


@dataclass(frozen=True)
class _Item:
    """One map entry of a signature or of `props`, with its CBOR size (key and value)."""

    key: str
    value: Any
    size: int

    @classmethod
    def of(cls, key: str, value: Any) -> _Item:
        return cls(key, value, len(cbor2.dumps(key)) + len(cbor2.dumps(value)))


def _take(items: Sequence[_Item], budget: int) -> tuple[dict[str, Any], int, int]:
    """The longest prefix of ``items`` within ``budget`` bytes: (entries, omitted, budget left).
    A prefix, not a best fit: the model's order is kept and nothing in the middle is missing."""
    taken: dict[str, Any] = {}
    for item in items:
        if item.size > budget:
            break
        taken[item.key] = item.value
        budget -= item.size
    return taken, len(items) - len(taken), budget


def _dim(d: Dim) -> int | str:
    return d if isinstance(d, int | str) else "?"


def _signature_items(specs: Sequence[TensorSpec]) -> tuple[_Item, ...]:
    return tuple(
        _Item.of(s.name, {"type": s.onnx_type, "shape": [_dim(d) for d in s.shape]}) for s in specs
    )


@dataclass(frozen=True)
class VersionDetails:
    """A ready version's signature and metadata as inventory entries, each sized once at the
    first inventory that lists the version; :meth:`within` cuts them to a byte share."""

    inputs: tuple[_Item, ...]
    outputs: tuple[_Item, ...]
    metadata: dict[str, Any] | None  # without props; None: the session has none
    props: tuple[_Item, ...]
    props_omitted: int  # already left out by the session (past its own bound)
    fixed_size: int  # bytes spent whatever the share: the metadata but props, map overhead

    @classmethod
    def of(cls, session: Session) -> VersionDetails:
        inputs, outputs = _signature_items(session.inputs), _signature_items(session.outputs)
        meta = session_metadata(session)
        if meta is None:
            return cls(inputs, outputs, None, (), 0, _OVERHEAD)
        metadata = {k: v for k, v in meta.items() if k not in ("props", "props_omitted")}
        props = meta.get("props")
        omitted = meta.get("props_omitted")
        return cls(
            inputs,
            outputs,
            metadata,
            tuple(_Item.of(str(k), str(v)) for k, v in props.items())
            if isinstance(props, Mapping)
            else (),
            omitted if isinstance(omitted, int) else 0,
            _OVERHEAD + len(cbor2.dumps(metadata)),
        )

    def within(self, share: int) -> dict[str, Any]:
        """``signature`` and ``metadata`` in about ``share`` CBOR bytes: inputs first, then
        outputs, then props, each in file order; the rest counted in ``omitted`` and
        ``props_omitted``. The metadata's other fields are small and always there."""
        inputs, inputs_left, budget = _take(self.inputs, share - self.fixed_size)
        outputs, outputs_left, budget = _take(self.outputs, budget)
        signature: dict[str, Any] = {"inputs": inputs, "outputs": outputs}
        if inputs_left or outputs_left:
            signature["omitted"] = {"inputs": inputs_left, "outputs": outputs_left}
        result: dict[str, Any] = {"signature": signature}
        if self.metadata is not None:
            props, props_left, _ = _take(self.props, budget)
            metadata = {**self.metadata, "props": props}
            if props_left + self.props_omitted:
                metadata["props_omitted"] = props_left + self.props_omitted
            result["metadata"] = metadata
        return result


def _details(loaded: LoadedVersion) -> VersionDetails:
    if loaded.details is None:
        loaded.details = VersionDetails.of(loaded.session)
    return loaded.details


def loaded_versions(models: Mapping[str, ModelRecord]) -> list[LoadedVersion]:
    """Every version of every model that holds a session (call with the manager's lock)."""
    return [e.loaded for r in models.values() for e in r.versions.values() if e.loaded is not None]


def device_bytes_of(versions: Sequence[LoadedVersion]) -> dict[tuple[str, int], int]:
    """GPU memory each version's session holds itself, by (model, version), where its backend
    counts it (the agent's TensorRT sessions: their buffers and kept arrays; not the engine's
    own, nor ONNX Runtime's)."""
    counts = {(v.model, v.version): session_device_bytes(v.session) for v in versions}
    return {key: count for key, count in counts.items() if count is not None}


def prefix_caches_of(versions: Sequence[LoadedVersion]) -> dict[tuple[str, int], tuple[int, int]]:
    """Each version's prefix cache (`[generate] prefix_cache_mb`), by (model, version): the
    bytes it holds and the prompt tokens it has served."""
    stores = {(v.model, v.version): v.generation for v in versions if v.generation}
    return {
        key: (g.prefix_cache.nbytes, g.prefix_cache.tokens_served)
        for key, g in stores.items()
        if g.prefix_cache is not None
    }


def inventory_of(
    models: Mapping[str, ModelRecord], *, detail_bytes: int = INVENTORY_DETAIL_BYTES
) -> dict[str, Any]:
    """The retained `ROOT/models` payload of the contract (the caller holds the lock).

    The one place it is built. Ready versions carry their signature and metadata, cut to a
    fair share of ``detail_bytes`` so the message stays under the broker's limit however
    many models and inputs there are (the floor aside: past ~90 ready versions it grows).
    """
    ready = sum(
        1
        for record in models.values()
        for entry in record.versions.values()
        if entry.loaded is not None and entry.state == "ready"
    )
    share = max(VERSION_DETAIL_FLOOR, detail_bytes // max(ready, 1))
    payload: dict[str, Any] = {}
    for name, record in sorted(models.items()):
        versions: dict[str, Any] = {}
        for number, entry in sorted(record.versions.items()):
            item: dict[str, Any] = {"state": entry.state, "backend": entry.backend}
            if entry.error:
                item["error"] = entry.error
            if entry.warmup is not None:
                item["warmup"] = entry.warmup
            if entry.signed is not None:
                item["signed"] = entry.signed
            if entry.state == "building" and entry.progress is not None:
                item["progress"] = entry.progress()
            if entry.loaded is not None and entry.state == "ready":
                item["providers"] = list(entry.loaded.session.providers)
                takes = text_inputs_of(entry.loaded)
                if takes:
                    item["text_inputs"] = takes
                item.update(_details(entry.loaded).within(share))
            versions[str(number)] = item
        payload[name] = {
            "serving": record.serving.version if record.serving else None,
            "versions": versions,
        }
    return {"models": payload}


def text_inputs_of(loaded: LoadedVersion) -> list[str]:
    """The inputs a request may send in place of the signature's: `prompt` (a tokenizer
    makes the token ids), `pair` (an encoder's second text a row), `messages` (a generate
    model's chat template lays them out), a speech recogniser's recording (`input_values`) or
    log-mel features (`input_features`) and previous text (`prompt`), an image-to-text
    model's picture (`pixel_values`)."""
    generation = loaded.generation
    if generation is not None:
        if generation.log_mel is not None:  # a speech recogniser: a recording (or its features)
            return [AUDIO_INPUT, FEATURES, TEXT_INPUT]
        if generation.image is not None:  # image to text: a picture
            return [PIXELS]
        if generation.tokenizer is None:
            return []
        return ["prompt", "messages"] if generation.chat is not None else ["prompt"]
    return ["prompt", "pair"] if loaded.text is not None else []


def summarize(inventory: Mapping[str, Any]) -> str:
    """One line per model for logs and the CLI."""
    lines = []
    for name, model in inventory.get("models", {}).items():
        states = ", ".join(f"v{n}:{v['state']}" for n, v in model["versions"].items())
        lines.append(f"{name}: serving {model['serving']} ({states})")
    return "\n".join(lines)


def _safe(value: object) -> str:
    """Text from the inventory (names and metadata come from model files) without control
    characters, which a terminal would act on."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def format_inventory(inventory: Mapping[str, Any]) -> str:
    """The inventory for a person: per model, per version its state, backend, warm-up and
    providers, then one line per input and output (`NAME  type  [dims]`) and the metadata."""
    lines: list[str] = []
    for name, model in inventory.get("models", {}).items():
        serving = model.get("serving")
        lines.append(f"{_safe(name)}  " + (f"serving v{serving}" if serving else "not serving"))
        for number, version in model.get("versions", {}).items():
            lines.extend(_version_lines(str(number), version))
    return "\n".join(lines) or "(no models)"


def _version_lines(number: str, version: Mapping[str, Any]) -> list[str]:
    head = [f"v{number}", str(version.get("state")), str(version.get("backend") or "-")]
    if version.get("warmup"):
        head.append(f"warmup {_safe(version['warmup'])}")
    if version.get("providers"):
        head.append("providers " + ",".join(_safe(p) for p in version["providers"]))
    lines = ["  " + "  ".join(head)]
    if version.get("error"):
        lines.append(f"    error: {_safe(version['error'])}")
    progress = version.get("progress")
    if isinstance(progress, Mapping):
        lines.append(f"    progress: {_progress_text(progress)}")
    if isinstance(version.get("signed"), Mapping):
        lines.append(f"    signed by: {_safe(version['signed'].get('by'))}")
    if version.get("text_inputs"):
        lines.append("    text in: " + ", ".join(_safe(n) for n in version["text_inputs"]))
    signature = version.get("signature") or {}
    for role in ("inputs", "outputs"):
        if role in signature:
            lines.append(f"    {role}:")
            lines.extend(_tensor_lines(signature[role]))
            omitted = (signature.get("omitted") or {}).get(role)
            if omitted:
                lines.append(f"      ... {omitted} more, left out of the inventory for size")
    if isinstance(version.get("metadata"), Mapping):
        lines.extend(_metadata_lines(version["metadata"]))
    return lines


def _progress_text(progress: Mapping[str, Any]) -> str:
    """An engine build's progress: `42 % (Tactic selection), 12.0 s of about 95.0 s`."""
    if progress.get("queued"):
        return "queued behind another engine build"
    parts = []
    if isinstance(progress.get("fraction"), int | float):
        phases = progress.get("phases") or []
        where = f" ({_safe(phases[-1].get('name'))})" if phases else ""
        parts.append(f"{progress['fraction'] * 100:.0f} %{where}")
    estimate = progress.get("estimate_s")
    about = f" of about {estimate:.1f} s" if isinstance(estimate, int | float) else ""
    parts.append(f"{progress.get('elapsed_s', 0):.1f} s{about}")
    return ", ".join(parts)


def _tensor_lines(tensors: Mapping[str, Any]) -> list[str]:
    """`NAME  type  [dims]`, the columns aligned."""
    rows = [
        (
            _safe(name),
            _safe(spec.get("type", "?")),
            "[" + ", ".join(_safe(d) for d in spec.get("shape", [])) + "]",
        )
        for name, spec in tensors.items()
    ]
    if not rows:
        return ["      (none)"]
    name_w = max(len(r[0]) for r in rows)
    type_w = max(len(r[1]) for r in rows)
    return [f"      {n:<{name_w}}  {t:<{type_w}}  {d}" for n, t, d in rows]


def _metadata_lines(meta: Mapping[str, Any]) -> list[str]:
    producer = " ".join(_safe(meta[k]) for k in ("producer", "producer_version") if meta.get(k))
    parts = [f"producer {producer or '?'}"]
    if meta.get("domain"):
        parts.append(f"domain {_safe(meta['domain'])}")
    for key, label in (("opset", "opset"), ("opset_ml", "ai.onnx.ml opset")):
        if meta.get(key) is not None:
            parts.append(f"{label} {meta[key]}")
    lines = ["    metadata: " + ", ".join(parts)]
    lines.extend(f"      {_safe(k)} = {_safe(v)}" for k, v in (meta.get("props") or {}).items())
    if meta.get("props_omitted"):
        lines.append(f"      ... {meta['props_omitted']} more props")
    return lines
