"""A `steps` loop bound once (agent.inference.fed_runs, agent.models.backends.ort_steps), on
real ONNX Runtime sessions: the bound steps give exactly the outputs of unbound ones, every
piece keeps its own arrays, and whatever breaks the plain feed (a member leaving, an output
changing shape, a closed session) runs unbound or fails as it did before."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from agent.demo import models as demo_models
from agent.inference import modes
from agent.models.backends.base import (
    Array,
    BackendOptions,
    InferenceError,
    Session,
    StepBinding,
    TensorSpec,
)
from agent.models.backends.onnxruntime import OnnxSession
from agent.models.backends.ort_steps import bindable
from agent.models.backends.registry import get_backend
from agent.models.model_config import StreamConfig


def _load(path: Path) -> OnnxSession:
    session = get_backend("onnxruntime").load(path, BackendOptions(intra_op_threads=1))
    assert isinstance(session, OnnxSession)
    return session


def _gru(tmp_path: Path) -> OnnxSession:
    path = tmp_path / "gru.onnx"
    demo_models.save(demo_models.gru_decoder(vocab=32, embed=8, hidden=8), path)
    return _load(path)


def _graph_session(tmp_path: Path, graph: onnx.GraphProto) -> OnnxSession:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "graph.onnx"
    onnx.save(model, path)
    return _load(path)


class Unbound:
    """The same session without `bind_steps`: how every step ran before, the reference."""

    def __init__(self, session: OnnxSession) -> None:
        self._session = session

    @property
    def inputs(self) -> Sequence[TensorSpec]:
        return self._session.inputs

    @property
    def outputs(self) -> Sequence[TensorSpec]:
        return self._session.outputs

    @property
    def providers(self) -> Sequence[str]:
        return self._session.providers

    def run(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        return self._session.run(inputs)

    def close(self) -> None:
        self._session.close()


class Counting(Unbound):
    """The session with `bind_steps`, counting bindings made and runs taken through them."""

    def __init__(self, session: OnnxSession) -> None:
        super().__init__(session)
        self.bindings = 0
        self.bound_runs = 0
        self.unbound_runs = 0

    def run(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        self.unbound_runs += 1
        return super().run(inputs)

    def bind_steps(
        self, inputs: Mapping[str, Any], outputs: Mapping[str, Any], links: Mapping[str, str]
    ) -> StepBinding | None:
        binding = self._session.bind_steps(inputs, outputs, links)
        if binding is None:
            return None
        self.bindings += 1
        counter = self

        class Counted:
            def run(self, copied: Collection[str]) -> dict[str, Array]:
                counter.bound_runs += 1
                assert binding is not None
                return binding.run(copied)

            def close(self) -> None:
                assert binding is not None
                binding.close()

        return Counted()


DECODER = StreamConfig(
    mode="steps",
    feed={"token": "next_token"},
    state={"h": "h_out"},
    emit=["next_token", "h_out"],
    max_steps=64,
)


def _outputs(session: Session, config: StreamConfig, members: list[modes.Member]) -> list[Any]:
    """Every piece's (member, index, last, outputs), in the order the run yields them."""
    run = modes.Run(session, config, members)
    return [
        (p.member, p.index, p.last, {k: v.copy() for k, v in p.outputs.items()}, p.outputs)
        for pieces in run.pieces()
        for p in pieces
    ]


def _same(bound: list[Any], unbound: list[Any]) -> None:
    assert len(bound) == len(unbound)
    for (m1, i1, l1, o1, _), (m2, i2, l2, o2, _) in zip(bound, unbound, strict=True):
        assert (m1, i1, l1) == (m2, i2, l2)
        assert o1.keys() == o2.keys()
        for name in o1:
            np.testing.assert_array_equal(o1[name], o2[name])


def _member(token: int, max_steps: int) -> modes.Member:
    return modes.Member(
        {"token": np.array([[token]], np.int64), "h": np.zeros((1, 8), np.float32)},
        max_steps=max_steps,
    )


def test_bound_steps_give_the_unbound_outputs_and_each_piece_its_own_arrays(
    tmp_path: Path,
) -> None:
    session = _gru(tmp_path)
    counting = Counting(session)
    bound = _outputs(counting, DECODER, [_member(3, 40)])
    unbound = _outputs(Unbound(session), DECODER, [_member(3, 40)])
    _same(bound, unbound)
    assert counting.bindings == 1
    assert (counting.unbound_runs, counting.bound_runs) == (1, 39)  # bound from the second step
    # The arrays the pieces kept (as `stream: false` stacks them) were never written again:
    for _member_pos, _index, _last, copied, kept in bound:
        for name in copied:
            np.testing.assert_array_equal(kept[name], copied[name])
    hidden = [kept["h_out"] for *_, kept in bound]
    assert len({id(h) for h in hidden}) == len(hidden)


def test_a_state_only_fed_back_is_not_copied_and_the_steps_stay_exact(tmp_path: Path) -> None:
    """`emit` the token alone: `h_out` and `logits` stay the binding's buffers, fed in place."""
    session = _gru(tmp_path)
    config = StreamConfig(
        mode="steps",
        feed={"token": "next_token"},
        state={"h": "h_out"},
        emit=["next_token"],
        max_steps=64,
    )
    counting = Counting(session)
    bound = _outputs(counting, config, [_member(5, 50)])
    _same(bound, _outputs(Unbound(session), config, [_member(5, 50)]))
    assert counting.bound_runs == 49
    assert all(kept.keys() == {"next_token"} for *_, kept in bound)
    # A member asking for the state (`params.outputs`) gets it copied, every step its own.
    asking = modes.Member(_member(5, 50).inputs, max_steps=50, select=["next_token", "h_out"])
    selected = _outputs(Counting(session), config, [asking])
    hidden = [kept["h_out"] for *_, kept in selected]
    assert len({id(h) for h in hidden}) == len(hidden)
    for *_, copied, kept in selected:
        np.testing.assert_array_equal(kept["h_out"], copied["h_out"])


def test_a_joined_run_rebinds_after_a_member_leaves(tmp_path: Path) -> None:
    session = _gru(tmp_path)
    counting = Counting(session)

    def members() -> list[modes.Member]:
        return [_member(1, 5), _member(2, 12), _member(7, 20)]

    bound = _outputs(counting, DECODER, members())
    _same(bound, _outputs(Unbound(session), DECODER, members()))
    # Bound, cut at step 5 (rebound a step later), cut at step 12 (again): three bindings.
    assert counting.bindings == 3
    assert counting.bound_runs == 20 - 3
    assert counting.unbound_runs == 3


def _growing(tmp_path: Path) -> OnnxSession:
    """`n_out = n + 1` (fed) and `seq = range(n)`, an output one longer every step."""
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["n", "one"], ["n_out"]),
            helper.make_node("Range", ["zero", "n", "one"], ["seq"]),
        ],
        "growing",
        [helper.make_tensor_value_info("n", TensorProto.INT64, [])],
        [
            helper.make_tensor_value_info("n_out", TensorProto.INT64, []),
            helper.make_tensor_value_info("seq", TensorProto.INT64, ["length"]),
        ],
        [
            helper.make_tensor("one", TensorProto.INT64, [], [1]),
            helper.make_tensor("zero", TensorProto.INT64, [], [0]),
        ],
    )
    return _graph_session(tmp_path, graph)


def test_an_output_that_changes_shape_runs_unbound_with_the_same_outputs(tmp_path: Path) -> None:
    session = _growing(tmp_path)
    counting = Counting(session)
    config = StreamConfig(mode="steps", feed={"n": "n_out"}, emit=["seq"], max_steps=6)
    bound = _outputs(counting, config, [modes.Member({"n": np.array(2, np.int64)}, max_steps=6)])
    assert [o["seq"].tolist() for *_, o, _kept in bound] == [list(range(k)) for k in range(2, 8)]
    # The first bound run met the longer `seq` and failed; the loop never bound again.
    assert (counting.bindings, counting.bound_runs, counting.unbound_runs) == (1, 1, 6)


def test_a_session_closed_under_a_bound_loop_fails_the_run(tmp_path: Path) -> None:
    session = _gru(tmp_path)
    run = modes.Run(session, DECODER, [_member(3, 40)])
    pieces = run.pieces()
    for _ in range(3):  # bound from the second step
        next(pieces)
    session.close()
    with pytest.raises(InferenceError, match="session closed"):
        next(pieces)


def test_only_numeric_tensors_with_exactly_matching_feeds_are_bound() -> None:
    token = np.zeros((1, 1), np.int64)
    hidden = np.zeros((1, 8), np.float32)
    links = {"token": "next_token", "h": "h_out"}
    outputs = {"next_token": token, "h_out": hidden}
    assert bindable({"token": token, "h": hidden}, outputs, links)
    assert not bindable({"token": token, "h": hidden}, outputs, {})  # nothing fed
    wider = {"next_token": token, "h_out": np.zeros((1, 9), np.float32)}
    assert not bindable({"token": token, "h": hidden}, wider, links)
    strings = {"token": token, "h": hidden, "label": np.array(["a"], dtype=object)}
    assert not bindable(strings, outputs, links)
    assert not bindable({"token": token, "h": hidden}, {"next_token": token}, links)
