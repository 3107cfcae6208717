"""A steps loop bound once with ONNX Runtime's IOBinding (docs/decisions/0032).

`InferenceSession.run` converts and checks every input and allocates every output on each
call: for a tiny decoder step that is a third of the call. :class:`OrtStepBinding` binds
two runs once, on the host: run A writes its outputs into buffer set A and reads its fed
inputs from set B, run B the other way round, and the inputs that are not fed stay bound
as they were. A step is then `run_with_iobinding`, and a copy of each output its caller
keeps past the next step (what a chunk carries: `stream: false` stacks them); the others (a
state only fed back, logits nobody asked for) are handed over as the buffers themselves.

Host buffers only: where a GPU provider runs the model, ORT copies the bound host buffers
to the device and back, which is what `run` does too, so only CPU sessions are bound.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import numpy as np

from agent.models.backends.base import Array, InferenceError

__all__ = ["OrtStepBinding", "bindable"]

# Element kinds a host buffer can hold for ORT by address: bool, ints, unsigned, floats.
_BINDABLE_KINDS = frozenset("biuf")


def bindable(
    inputs: Mapping[str, Array], outputs: Mapping[str, Array], links: Mapping[str, str]
) -> bool:
    """True where every tensor is numeric and every fed output matches its input exactly
    (the loop checks this as it feeds; a mismatch there is the request's error)."""
    tensors = (*inputs.values(), *outputs.values())
    if not links or not all(
        isinstance(t, np.ndarray) and t.dtype.kind in _BINDABLE_KINDS for t in tensors
    ):
        return False
    for target, source in links.items():
        value, expected = outputs.get(source), inputs.get(target)
        if value is None or expected is None:
            return False
        if value.dtype != expected.dtype or value.shape != expected.shape:
            return False
    return True


class OrtStepBinding:
    """Two IOBindings of one ORT session whose fed outputs are each other's inputs."""

    def __init__(
        self,
        live_session: Callable[[], Any],
        inputs: Mapping[str, Array],
        outputs: Mapping[str, Array],
        links: Mapping[str, str],
        one_line: Callable[[BaseException], str],
    ) -> None:
        self._live_session = live_session
        self._one_line = one_line
        session = live_session()
        # Outputs into fresh C-ordered buffers shaped as the last run's; the run that would
        # make them another shape fails (ORT checks a bound output's shape) and is run again
        # unbound by the loop.
        self._buffers = [
            {name: np.empty(value.shape, value.dtype) for name, value in outputs.items()}
            for _ in range(2)
        ]
        self._fixed = {
            name: np.ascontiguousarray(value) for name, value in inputs.items() if name not in links
        }
        self._bindings = [self._bind(session, k, links) for k in range(2)]
        for source in links.values():  # the first bound run (A) reads set B
            np.copyto(self._buffers[1][source], outputs[source])
        self._next = 0

    def _bind(self, session: Any, k: int, links: Mapping[str, str]) -> Any:
        binding = session.io_binding()
        for name, value in self._fixed.items():
            binding.bind_cpu_input(name, value)
        fed_from = self._buffers[1 - k]
        for target, source in links.items():
            binding.bind_cpu_input(target, fed_from[source])
        for name, buffer in self._buffers[k].items():
            binding.bind_output(
                name, "cpu", 0, buffer.dtype, list(buffer.shape), buffer.ctypes.data
            )
        return binding

    def run(self, copied: Collection[str]) -> dict[str, Array]:
        k = self._next
        session = self._live_session()
        try:
            session.run_with_iobinding(self._bindings[k])
        except Exception as exc:
            raise InferenceError(self._one_line(exc)) from exc
        self._next = 1 - k
        return {
            name: buffer.copy() if name in copied else buffer
            for name, buffer in self._buffers[k].items()
        }

    def close(self) -> None:
        """Let go of the bindings and their buffers (the session keeps running)."""
        for binding in self._bindings:
            binding.clear_binding_inputs()
            binding.clear_binding_outputs()
        self._bindings = []
        self._buffers = []
        self._fixed = {}
