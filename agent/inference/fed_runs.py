"""The `steps` loop's runs of the model, bound once where the session can (docs/decisions/0032).

A decode step of a tiny model costs less than ONNX Runtime's per-call work (converting the
inputs, allocating the outputs). Once two runs in a row are a plain feed (the second's
inputs are the first's, with the fed outputs in their place), :class:`FedRuns` asks the
session for a :class:`~agent.models.backends.base.StepBinding` and runs the next steps
through it, as long as the loop keeps feeding. Anything else (rows cut when a member leaves,
a bound run that fails, a session that cannot bind) runs unbound, as every other mode does;
the outputs are the same either way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from agent.models.backends.base import Array, InferenceError, StepBinding, bind_steps

if TYPE_CHECKING:
    from agent.inference.modes import Run

__all__ = ["FedRuns"]

Arrays = dict[str, Array]


class FedRuns:
    """Runs one steps loop's model, bound while the loop only feeds; see the module."""

    def __init__(self, run: Run, links: Mapping[str, str]) -> None:
        self._run = run
        self._links = dict(links)  # input <- output
        self._binding: StepBinding | None = None
        self._may_bind = bool(links)
        self._last: tuple[Arrays, Arrays] | None = None  # the last run's inputs and outputs
        self._kept: frozenset[str] = frozenset()  # outputs copied out of a bound run

    def model(self, inputs: Arrays) -> Arrays:
        """One run of the model on `inputs`, bound where they continue the last run."""
        outputs = None
        if self._may_bind and self._continues(inputs):
            outputs = self._bound(inputs)
        elif self._binding is not None:
            self._drop()
        if outputs is None:
            outputs = self._run.model(inputs)
        self._last = (inputs, outputs)
        return outputs

    def close(self) -> None:
        if self._binding is not None:
            self._drop()
        self._last = None

    def _continues(self, inputs: Arrays) -> bool:
        """True where `inputs` are the last run's with its fed outputs in place (the very
        arrays: the loop's `_fed`, nothing cut or replaced)."""
        if self._last is None:
            return False
        last_inputs, last_outputs = self._last
        if len(inputs) != len(last_inputs):
            return False
        links = self._links
        for name, value in inputs.items():
            source = links.get(name)
            if value is not (last_inputs.get(name) if source is None else last_outputs.get(source)):
                return False
        return True

    def _bound(self, inputs: Arrays) -> Arrays | None:
        """The bound run's outputs, or None where it cannot be bound (then never again in
        this loop: a model that binds badly is not asked every step)."""
        if self._binding is None:
            assert self._last is not None  # `_continues` held
            self._binding = bind_steps(self._run.session, inputs, self._last[1], self._links)
            if self._binding is None:
                self._may_bind = False
                return None
            self._kept = self._carried(self._last[1])
        try:
            return self._run.bound(self._binding, self._kept)
        except InferenceError:  # e.g. an output changed shape: the unbound run says why
            self._drop()
            self._may_bind = False
            return None

    def _carried(self, outputs: Arrays) -> frozenset[str]:
        """The outputs some member's chunks carry (`_chosen`): the ones kept past the step.
        The rest (a state only fed back, logits nobody asked for) are never copied."""
        run = self._run
        names: set[str] = set()
        for member in run.members:
            names.update(member.select or run.emitted(outputs))
        return frozenset(names)

    def _drop(self) -> None:
        assert self._binding is not None
        self._binding.close()
        self._binding = None
