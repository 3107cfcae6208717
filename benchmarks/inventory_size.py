"""How large the retained `ROOT/models` inventory gets: models × inputs -> CBOR bytes.

The inventory carries every ready version's signature, and it is retained on MQTT, so it must
fit one message (128 KB at AWS IoT Core). Decoder models are the worst case: one input and
one output per layer's past key and value, with long names and four dims each. This builds
inventories of 1, 10 and 50 such models with 10 or 100 inputs (and as many outputs) through
the agent's own builder, and prints their CBOR size as sent and as it would be uncut.

    .venv/bin/python benchmarks/inventory_size.py
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from agent.models.backends.base import Array, TensorSpec
from agent.models.model_config import ModelConfig
from agent.models.records import LoadedVersion, ModelRecord, VersionRecord, inventory_of
from agent.protocol.payload import encode_payload

LIMIT = 128 * 1024  # AWS IoT Core's message limit, the agent's default budget
SHAPES = [(1, 10), (1, 100), (10, 10), (10, 100), (50, 10), (50, 100), (100, 100), (200, 100)]
_FLOAT = np.dtype(np.float32)
_INT64 = np.dtype(np.int64)
KV_DIMS = ("batch_size", 12, "past_sequence_length", 64)
METADATA = {
    "producer": "pytorch",
    "producer_version": "2.1.0",
    "domain": "",
    "opset": 17,
    "props": {"model_type": "gpt2", "exported_by": "optimum 1.16.1"},
}


def decoder_specs(count: int, prefix: str) -> list[TensorSpec]:
    """``count`` specs named like a transformers export: ids and mask, then past keys and
    values (``past_key_values.12.key``) or, for outputs, logits and ``present.12.key``."""
    if prefix == "past_key_values":
        head = [
            TensorSpec("input_ids", _INT64, ("batch_size", "sequence_length")),
            TensorSpec("attention_mask", _INT64, ("batch_size", "total_sequence_length")),
        ]
    else:
        head = [TensorSpec("logits", _FLOAT, ("batch_size", "sequence_length", 50257))]
    specs = head[:count]
    layer = 0
    while len(specs) < count:
        for kind in ("key", "value"):
            if len(specs) < count:
                specs.append(TensorSpec(f"{prefix}.{layer}.{kind}", _FLOAT, KV_DIMS))
        layer += 1
    return specs


class FakeSession:
    """What the inventory reads of a loaded ONNX Runtime session."""

    def __init__(self, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> None:
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.providers = ("CPUExecutionProvider",)
        self.metadata = METADATA

    def run(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        raise NotImplementedError

    def close(self) -> None:
        pass


def records(models: int, inputs: int) -> dict[str, ModelRecord]:
    """``models`` ready decoders of ``inputs`` inputs and as many outputs, named like a fleet."""
    result = {}
    for m in range(models):
        name = f"decoder-{m:02d}-gpt2-medium-int8"
        session = FakeSession(
            decoder_specs(inputs, "past_key_values"), decoder_specs(inputs, "present")
        )
        loaded = LoadedVersion(name, 1, session, ModelConfig(), "onnxruntime")
        entry = VersionRecord("ready", "onnxruntime", loaded=loaded, warmup="ok")
        result[name] = ModelRecord(name, serving=loaded, versions={1: entry})
    return result


def inventory_size(models: int, inputs: int, *, uncut: bool = False) -> tuple[int, int, int]:
    """(CBOR bytes, inputs omitted, outputs omitted) of the inventory, the omissions summed
    over all models (``uncut``: no budget)."""
    kwargs: dict[str, Any] = {"detail_bytes": 1 << 40} if uncut else {}
    inventory = inventory_of(records(models, inputs), **kwargs)
    omitted = [
        version["signature"].get("omitted", {})
        for model in inventory["models"].values()
        for version in model["versions"].values()
    ]
    return (
        len(encode_payload(inventory)),
        sum(o.get("inputs", 0) for o in omitted),
        sum(o.get("outputs", 0) for o in omitted),
    )


def table() -> str:
    lines = [
        "| models | inputs, outputs each | CBOR bytes | inputs listed | outputs listed | uncut |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for models, inputs in SHAPES:
        size, inputs_left, outputs_left = inventory_size(models, inputs)
        uncut = inventory_size(models, inputs, uncut=True)[0]
        total = models * inputs
        lines.append(
            f"| {models} | {inputs} | {size:,} | {total - inputs_left:,} | "
            f"{total - outputs_left:,} | {uncut:,} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
    print(f"\nlimit: {LIMIT:,} bytes (AWS IoT Core; mqtt.max_packet_bytes = 131072)")
