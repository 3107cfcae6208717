"""Cutting a kept output where it lies: the first n entries of a decoder's cache along its past
axis, as a new `OrtValue` on the session's device (ONNX Runtime).

A generate loop that keeps its cache on the GPU (`DeviceBinding.run_keeping`) sometimes needs
it shorter than the run left it: prompt lookup's run reads guesses that were not all kept
(`agent.inference.prompt_lookup`). numpy cannot cut a device's memory, and ONNX Runtime's
Python API has no slice of an `OrtValue`, so the cut is a one-node graph (`Slice`, its end an
input) opened on the session's own providers and options, run with IOBinding: the value goes
in and comes out on the device, never through the host. One graph per element type, rank and
axis, made on first use.

Imports onnx and onnxruntime (given the session), nothing of the agent.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

__all__ = ["DeviceCutter"]

# The cache dtypes a decoder uses, as ONNX's enum (`OrtValue.element_type()`'s answer).
_ELEMENT_TYPES = {1: "float", 10: "float16", 11: "double", 16: "bfloat16"}


class DeviceCutter:
    """Cuts values kept by one ONNX Runtime session, on its device (`kind`, `index`)."""

    def __init__(self, session: Any, device: tuple[str, int]) -> None:
        self._providers = list(session.get_providers())
        options = session.get_provider_options()
        self._provider_options = [dict(options.get(p, {})) for p in self._providers]
        self._device = device
        self._graphs: dict[tuple[int, int, int], Any] = {}
        self._lock = threading.Lock()

    def cut(self, value: Any, axis: int, length: int) -> Any:
        """`value`'s first `length` entries along `axis` (`value` itself where it holds no
        more), a new value on the device; ValueError for an element type it cannot cut."""
        shape = list(value.shape())
        if shape[axis] == length:
            return value
        graph = self._graph(value.element_type(), len(shape), axis)
        binding = graph.io_binding()
        binding.bind_ortvalue_input("x", value)
        binding.bind_cpu_input("end", np.array([length], dtype=np.int64))
        binding.bind_output("y", *self._device)
        graph.run_with_iobinding(binding)
        return binding.get_outputs()[0]

    def _graph(self, element_type: int, rank: int, axis: int) -> Any:
        key = (element_type, rank, axis)
        with self._lock:
            graph = self._graphs.get(key)
            if graph is None:
                graph = self._graphs[key] = self._open(element_type, rank, axis)
            return graph

    def _open(self, kind: int, rank: int, axis: int) -> Any:
        import onnx
        import onnxruntime as ort
        from onnx import TensorProto, helper

        if kind not in _ELEMENT_TYPES:
            raise ValueError(f"cannot cut a tensor of ONNX element type {kind} on the device")
        dims = [f"d{i}" for i in range(rank)]
        node = helper.make_node("Slice", ["x", "start", "end", "axis"], ["y"])
        graph = helper.make_graph(
            [node],
            "cut",
            [
                helper.make_tensor_value_info("x", kind, dims),
                helper.make_tensor_value_info("end", TensorProto.INT64, [1]),
            ],
            [helper.make_tensor_value_info("y", kind, [None] * rank)],
            [
                helper.make_tensor("start", TensorProto.INT64, [1], [0]),
                helper.make_tensor("axis", TensorProto.INT64, [1], [axis]),
            ],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
        model.ir_version = 8
        onnx.checker.check_model(model)
        return ort.InferenceSession(
            model.SerializeToString(),
            providers=self._providers,
            provider_options=self._provider_options,
        )
