"""Small, real ONNX models built in code, so tests and demos need no downloaded weights.

Every builder is deterministic for a given seed (weights come from numpy's PCG64 generator),
targets opset 17 and IR version 8, which ONNX Runtime 1.17 and later load, and stays far
below 100 KB so the example repository can live in git.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = [
    "IR_VERSION",
    "OPSET",
    "conv_net",
    "gru_decoder",
    "mlp",
    "save",
    "to_bytes",
    "write_atomic",
]

OPSET = 17
IR_VERSION = 8  # the newest IR that ONNX Runtime 1.17 (JetPack 6's wheels) fully supports
PRODUCER = "edge-stream-agent.demo.models"
AVOID_BIAS = -1.0e4


class _Graph:
    """Collects nodes and initializers so each builder reads like the network it makes."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def weight(self, name: str, shape: tuple[int, ...], fan_in: int) -> str:
        """A float32 weight scaled by 1/sqrt(fan_in), so activations stay in a sane range."""
        values = self.rng.standard_normal(shape) / np.sqrt(fan_in)
        return self.const(name, values.astype(np.float32))

    def const(self, name: str, values: npt.NDArray[Any]) -> str:
        self.initializers.append(numpy_helper.from_array(values, name=name))
        return name

    def node(self, op: str, inputs: list[str], output: str, **attrs: Any) -> str:
        self.nodes.append(helper.make_node(op, inputs, [output], name=output, **attrs))
        return output

    def model(
        self,
        name: str,
        inputs: list[onnx.ValueInfoProto],
        outputs: list[onnx.ValueInfoProto],
        doc: str,
    ) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes, name, inputs, outputs, initializer=self.initializers, doc_string=doc
        )
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", OPSET)],
            producer_name=PRODUCER,
            producer_version="1",
            doc_string=doc,
        )
        model.ir_version = IR_VERSION
        onnx.checker.check_model(model, full_check=True)
        return model


def _tensor(name: str, elem_type: int, shape: list[int | str]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, shape)


def mlp(
    inputs: int = 16,
    hidden: int = 64,
    outputs: int = 8,
    seed: int = 0,
    hidden_layers: int = 1,
) -> onnx.ModelProto:
    """Gemm layers with a Relu after each hidden one: by default the smallest model with a
    batch axis to slice; `hidden_layers = 2` and 1024 wide is the 256-1024-1024-10 MLP whose
    weights (5 MB) make a single request memory-bound, as real scoring models are."""
    if hidden_layers < 1:
        raise ValueError(f"hidden_layers must be >= 1, got {hidden_layers}")
    g = _Graph(np.random.default_rng(seed))
    h, width = "x", inputs
    for layer in range(1, hidden_layers + 1):
        w = g.weight(f"w{layer}", (width, hidden), width)
        b = g.const(f"b{layer}", np.zeros(hidden, dtype=np.float32))
        h = g.node("Relu", [g.node("Gemm", [h, w, b], f"fc{layer}")], f"relu{layer}")
        width = hidden
    last = hidden_layers + 1
    w_out = g.weight(f"w{last}", (hidden, outputs), hidden)
    b_out = g.const(f"b{last}", np.zeros(outputs, dtype=np.float32))
    g.node("Gemm", [h, w_out, b_out], "y")
    sizes = "-".join(str(n) for n in (inputs, *[hidden] * hidden_layers, outputs))
    return g.model(
        "mlp",
        [_tensor("x", TensorProto.FLOAT, ["batch", inputs])],
        [_tensor("y", TensorProto.FLOAT, ["batch", outputs])],
        f"MLP {sizes}, seed {seed}",
    )


def gru_decoder(
    vocab: int = 32,
    embed: int = 16,
    hidden: int = 32,
    seed: int = 0,
    avoid_token: int | None = 0,
) -> onnx.ModelProto:
    """One greedy decoder step of a GRU language model, with its state as input and output.

    The agent loops it: ``token <- next_token`` and ``h <- h_out``. Random weights would
    sometimes pick token 0 (the usual end token) early, so by default its logit is pushed
    down by 1e4 and a demo stream always runs to ``max_steps``; ``avoid_token=None`` keeps
    the logits as the weights make them.
    """
    if avoid_token is not None and not 0 <= avoid_token < vocab:
        raise ValueError(f"avoid_token must be in 0..{vocab - 1} or None, got {avoid_token}")
    g = _Graph(np.random.default_rng(seed))
    table = g.const("embedding", g.rng.standard_normal((vocab, embed)).astype(np.float32))
    emb = g.node("Gather", [table, "token"], "embedded", axis=0)  # [batch, 1, embed]
    x = g.node("Squeeze", [emb, g.const("axis1", np.array([1], dtype=np.int64))], "x")

    def gate(name: str, h_in: str) -> str:
        """x @ W + h_in @ U + b, the pre-activation shared by the three GRU gates."""
        wx = g.node("MatMul", [x, g.weight(f"w_{name}", (embed, hidden), embed)], f"wx_{name}")
        uh = g.node("MatMul", [h_in, g.weight(f"u_{name}", (hidden, hidden), hidden)], f"uh_{name}")
        bias = g.const(f"b_{name}", np.zeros(hidden, dtype=np.float32))
        return g.node("Add", [g.node("Add", [wx, uh], f"sum_{name}"), bias], f"pre_{name}")

    z = g.node("Sigmoid", [gate("z", "h")], "z")  # update gate
    r = g.node("Sigmoid", [gate("r", "h")], "r")  # reset gate
    n = g.node("Tanh", [gate("n", g.node("Mul", [r, "h"], "rh"))], "n")  # candidate
    # h_out = (1 - z) * n + z * h = n + z * (h - n)
    delta = g.node("Mul", [z, g.node("Sub", ["h", n], "h_minus_n")], "z_delta")
    g.node("Add", [n, delta], "h_out")

    out_bias = np.zeros(vocab, dtype=np.float32)
    if avoid_token is not None:
        out_bias[avoid_token] = AVOID_BIAS
    w_out = g.weight("w_out", (hidden, vocab), hidden)
    g.node("Gemm", ["h_out", w_out, g.const("b_out", out_bias)], "logits")
    g.node("ArgMax", ["logits"], "next_token", axis=1, keepdims=1)
    return g.model(
        "gru_decoder",
        [
            _tensor("token", TensorProto.INT64, ["batch", 1]),
            _tensor("h", TensorProto.FLOAT, ["batch", hidden]),
        ],
        [
            _tensor("next_token", TensorProto.INT64, ["batch", 1]),
            _tensor("logits", TensorProto.FLOAT, ["batch", vocab]),
            _tensor("h_out", TensorProto.FLOAT, ["batch", hidden]),
        ],
        f"GRU decoder step vocab {vocab}, embed {embed}, hidden {hidden}, seed {seed}, "
        f"avoid_token {avoid_token}",
    )


def conv_net(
    channels: int = 3, size: int = 32, classes: int = 10, seed: int = 0
) -> onnx.ModelProto:
    """A tiny image classifier: two conv blocks, global pooling and a linear head."""
    if size < 4 or size % 4:
        raise ValueError(f"size must be a multiple of 4 (two 2x2 poolings), got {size}")
    g = _Graph(np.random.default_rng(seed))
    widths = [channels, 8, 16]
    x = "image"
    for i, (c_in, c_out) in enumerate(itertools.pairwise(widths), start=1):
        w = g.weight(f"conv{i}_w", (c_out, c_in, 3, 3), c_in * 9)
        b = g.const(f"conv{i}_b", np.zeros(c_out, dtype=np.float32))
        x = g.node("Conv", [x, w, b], f"conv{i}", kernel_shape=[3, 3], pads=[1, 1, 1, 1])
        x = g.node("Relu", [x], f"relu{i}")
        x = g.node("MaxPool", [x], f"pool{i}", kernel_shape=[2, 2], strides=[2, 2])
    x = g.node("Flatten", [g.node("GlobalAveragePool", [x], "gap")], "features", axis=1)
    w = g.weight("fc_w", (widths[-1], classes), widths[-1])
    g.node("Gemm", [x, w, g.const("fc_b", np.zeros(classes, dtype=np.float32))], "scores")
    return g.model(
        "conv_net",
        [_tensor("image", TensorProto.FLOAT, ["batch", channels, size, size])],
        [_tensor("scores", TensorProto.FLOAT, ["batch", classes])],
        f"conv net {channels}x{size}x{size} -> {classes}, seed {seed}",
    )


def to_bytes(model: onnx.ModelProto) -> bytes:
    """The serialized model; equal models give equal bytes, which keeps regeneration quiet."""
    data: bytes = model.SerializeToString(deterministic=True)
    return data


def save(model: onnx.ModelProto, path: Path | str) -> Path:
    """Write the model atomically: a watcher never sees a half-written model file."""
    return write_atomic(Path(path), to_bytes(model))


def write_atomic(path: Path, data: bytes) -> Path:
    """Write to a temporary file in the same folder, fsync it, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
