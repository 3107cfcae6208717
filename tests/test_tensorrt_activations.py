"""An execution context's activation memory given by the agent (`tensorrt.activation_memory =
"by_run"`, agent/models/backends/tensorrt/activations.py, decision 0038).

Against the tensorrt/pycuda test doubles (tests/fakes), which model what the real bindings do
(NVIDIA/TensorRT python/src/infer/pyCore.cpp of 8.6.1, 10.0, 10.1, 10.13): a context made
without memory refuses to enqueue until it is given some, 10.x sizes it by the current
profile, a run scribbles over it. Not run on a GPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from agent.demo import models as demo_models
from agent.models.backends.base import BackendOptions, InferenceError, ModelLoadError
from agent.models.backends.cuda import size_class
from agent.models.backends.tensorrt import TensorRTBackend
from agent.models.decoder_layout import open_generation
from agent.models.engine_builder import ShapeRange
from tests import fakes
from tests.fakes import FakeGPU
from tests.fakes import tensorrt as fake_trt
from tests.generate_helpers import REFERENCE
from tests.test_decoder_engine import _greedy, decoder_version
from tests.test_decoder_engine import build as build_decoder
from tests.test_tensorrt_backend import RNG, build, load, reference, rel_err

fake_gpu = fakes.fake_gpu  # the fixture

SMALL = {"x": ShapeRange((1, 16), (2, 16), (4, 16))}
LARGE = {"x": ShapeRange((5, 16), (8, 16), (16, 16))}


def profile_bytes(batch: int) -> int:
    """The fake's activation memory of a profile whose largest `x` is [batch, 16] float32."""
    return fake_trt.ACTIVATION_BYTES + fake_trt.ACTIVATION_PER_BYTE * batch * 16 * 4


def activation_allocations(gpu: FakeGPU) -> list[int]:
    """Device allocations of the agent's larger than any staging buffer of these tests."""
    return sorted(
        r.nbytes
        for r in gpu.live("device")
        if r.label == "mem_alloc" and r.nbytes >= fake_trt.ACTIVATION_BYTES
    )


@pytest.mark.parametrize("fake_gpu", ["8.5.3", "8.6.1", "10.0.1", "10.3.0"], indirect=True)
def test_by_run_contexts_get_the_memory_their_profile_needs(
    fake_gpu: FakeGPU, tmp_path: Path
) -> None:
    """No context holds activation memory of its own; each run gets what TensorRT says it
    needs (10.x: the run's profile; 8.x: the engine's most), through the API of the
    version; outputs stay right though the fake scribbles over that memory; an idle
    session gives it back and the next run makes it again."""
    plan = build(tmp_path, demo_models.mlp(), "mlp", profiles=(SMALL, LARGE))
    session = load(plan, activation_memory="by_run")
    sized_by_profile = fake_gpu.trt >= (10, 0)
    try:
        assert fake_gpu.live("trt-context") == []
        largest = 4
        for batch in (2, 3, 12, 1):
            x = RNG.standard_normal((batch, 16)).astype(np.float32)
            y = session.run({"x": x})["y"]
            assert rel_err(y, reference(demo_models.mlp(), {"x": x})["y"]) < 1e-6
            largest = max(largest, 16 if batch > 4 else 4) if sized_by_profile else 16
            assert activation_allocations(fake_gpu) == [size_class(profile_bytes(largest))]
        sets = [e.details["size"] for e in fake_gpu.events if e.name == "device_memory_set"]
        assert len(sets) == 4  # given before every run
        if fake_gpu.trt >= (10, 1):
            assert all(size is not None and size >= profile_bytes(16) for size in sets[2:])
        else:
            assert sets == [None] * 4  # the write-only `device_memory` attribute
        held = session.device_bytes
        assert session.release_idle(idle_s=0) > 0 and activation_allocations(fake_gpu) == []
        x = RNG.standard_normal((2, 16)).astype(np.float32)
        assert (
            rel_err(session.run({"x": x})["y"], reference(demo_models.mlp(), {"x": x})["y"]) < 1e-6
        )
        assert 0 < session.device_bytes <= held
    finally:
        session.close()
    assert fake_gpu.live("device") == []


def test_static_contexts_hold_the_engines_memory_themselves(
    fake_gpu: FakeGPU, tmp_path: Path
) -> None:
    """The default: TensorRT gives each context the engine's largest profile's memory when it
    is made; the agent gives none."""
    session = load(build(tmp_path, demo_models.mlp(), "mlp", profiles=(SMALL, LARGE)))
    try:
        session.run({"x": np.ones((2, 16), np.float32)})
        assert [r.nbytes for r in fake_gpu.live("trt-context")] == [profile_bytes(16)]
        assert activation_allocations(fake_gpu) == []
        assert "device_memory_set" not in fake_gpu.names()
    finally:
        session.close()


def test_a_run_without_room_for_its_activations_is_refused_and_the_next_runs(
    fake_gpu: FakeGPU, tmp_path: Path
) -> None:
    session = load(
        build(tmp_path, demo_models.mlp(), "mlp", profiles=(SMALL, LARGE)),
        activation_memory="by_run",
    )
    try:
        session.run({"x": np.ones((2, 16), np.float32)})
        fake_gpu.total_memory = fake_gpu.device_bytes + 8192  # room for staging, not activations
        with pytest.raises(InferenceError, match="no device memory for the engine's activations"):
            session.run({"x": np.ones((12, 16), np.float32)})
        assert session.run({"x": np.ones((2, 16), np.float32)})["y"].shape == (2, 8)
        fake_gpu.total_memory = 8 * 1024**3
        assert session.run({"x": np.ones((12, 16), np.float32)})["y"].shape == (12, 8)
        assert session.contexts == 1
    finally:
        session.close()


def test_an_unknown_activation_memory_is_refused_by_name(mlp_plan_path: Path) -> None:
    with pytest.raises(
        ModelLoadError, match=r"activation_memory must be one of 'static', 'by_run'"
    ):
        load(mlp_plan_path, activation_memory="dynamic")


@pytest.fixture
def mlp_plan_path(fake_gpu: FakeGPU, tmp_path: Path) -> Path:
    return build(tmp_path, demo_models.mlp(), "mlp")


@pytest.mark.parametrize("fake_gpu", ["8.6.1", "10.3.0"], indirect=True)
def test_the_fake_refuses_a_context_made_without_memory_until_given_some(
    fake_gpu: FakeGPU, mlp_plan_path: Path
) -> None:
    """The double itself, as the bindings are: the way to make such a context per version,
    a write-only `device_memory`, and enqueue refused (False, the reason logged) without it."""
    session = load(mlp_plan_path)
    try:
        engine = session._engine
        if fake_gpu.trt >= (10, 0):
            strategy = fake_trt.ExecutionContextAllocationStrategy.USER_MANAGED
            context = engine.create_execution_context(strategy)
            with pytest.warns(DeprecationWarning):
                engine.create_execution_context_without_device_memory()
        else:
            assert not hasattr(fake_trt, "ExecutionContextAllocationStrategy")
            with pytest.raises(TypeError):
                engine.create_execution_context(0)
            context = engine.create_execution_context_without_device_memory()
        assert context.set_input_shape("x", (1, 16))
        for name in ("x", "y"):
            context.set_tensor_address(name, fake_gpu.allocate(4096, "device", name).address)
        assert not context.execute_async_v3(0)
        with pytest.raises(AttributeError):
            context.device_memory  # noqa: B018 (write-only, as pybind's def_property(nullptr, ...))
        context.device_memory = fake_gpu.allocate(
            engine.device_memory_size, "device", "act"
        ).address
        assert context.execute_async_v3(0)
    finally:
        session.close()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_decoder_generates_the_same_tokens_with_memory_given_by_run(
    fake_gpu: FakeGPU, tmp_path: Path, arch: str
) -> None:
    """A decoder's prefill and one-token steps run under different profiles' memory, its
    cache kept on the device meanwhile: the Hugging Face greedy tokens all the same."""
    onnx = decoder_version(tmp_path, arch)
    options = BackendOptions(extra={"tensorrt": {"activation_memory": "by_run"}})
    session = TensorRTBackend().load(build_decoder(tmp_path, onnx), options)
    try:
        setup = open_generation(None, session, onnx.parent)
        case = REFERENCE["models"][arch][0]
        tokens = _greedy(session, setup, case["ids"], 40)
        assert tokens[: len(case["greedy"])] == case["greedy"]
        assert fake_gpu.live("trt-context") == []
    finally:
        session.close()


ONE_PROFILE = {"x": ShapeRange((1, 16), (4, 16), (16, 16))}


@pytest.mark.parametrize("fake_gpu", ["10.10.0"], indirect=True)
def test_an_engine_built_to_resize_gives_each_run_what_its_shapes_need(
    fake_gpu: FakeGPU, tmp_path: Path
) -> None:
    """Built with RUNTIME_ACTIVATION_RESIZE_10_10 (`activation_resize`, what the agent's own
    builds ask for a model with `activation_memory = "by_run"`), a small run of a profile
    gets a small part of what the profile's largest would: a decoder's one-token steps
    need less than its prefill."""
    plan = build(
        tmp_path, demo_models.mlp(), "mlp", profiles=(ONE_PROFILE,), activation_resize=True
    )
    session = load(plan, activation_memory="by_run")
    try:
        for batch, want in ((2, 2), (16, 16), (1, 16)):  # grown by 16, kept until trimmed
            x = RNG.standard_normal((batch, 16)).astype(np.float32)
            y = session.run({"x": x})["y"]
            assert rel_err(y, reference(demo_models.mlp(), {"x": x})["y"]) < 1e-6
            assert activation_allocations(fake_gpu) == [size_class(profile_bytes(want))]
    finally:
        session.close()


@pytest.mark.parametrize("fake_gpu", ["10.3.0"], indirect=True)
def test_before_10_10_the_engine_is_built_without_resizing_and_says_so(
    fake_gpu: FakeGPU, tmp_path: Path
) -> None:
    from agent.models.engine_builder import BuildOptions, build_engine

    said: list[str] = []
    onnx_path = demo_models.save(demo_models.mlp(), tmp_path / "models" / "mlp" / "1" / "m.onnx")
    options = BuildOptions(
        cache_dir=tmp_path / "cache",
        progress=said.append,
        profiles=(ONE_PROFILE,),
        activation_resize=True,
    )
    session = load(
        build_engine(onnx_path, tmp_path / "models" / "mlp", options), activation_memory="by_run"
    )
    try:
        session.run({"x": np.ones((2, 16), np.float32)})
        assert activation_allocations(fake_gpu) == [size_class(profile_bytes(16))]
    finally:
        session.close()
    assert any("RUNTIME_ACTIVATION_RESIZE_10_10 came in 10.10" in line for line in said), said


def test_the_agents_builds_resize_where_runs_give_the_memory() -> None:
    """`tensorrt.activation_memory = "by_run"` makes the agent's own builds ask for it, and
    the option is part of the engine cache's key (an engine built without is not reused)."""
    from agent.models.engine_builds import build_options

    by_run = build_options(BackendOptions(extra={"tensorrt": {"activation_memory": "by_run"}}))
    static = build_options(BackendOptions(extra={"tensorrt": {}}))
    assert by_run.activation_resize and not static.activation_resize
    assert by_run.key_fields() != static.key_fields()
    assert "activation_resize" not in static.key_fields()  # older cache keys stay as they were
