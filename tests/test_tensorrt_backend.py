"""The TensorRT backend against the tensorrt/pycuda test doubles (tests/fakes).

What runs here is the agent's code path, call for call, on fakes that mirror the real API
(return types, None on bad plans, -1 dims, removed binding API, per-thread CUDA contexts,
deferred stream work, device memory accounting). Whether real TensorRT behaves the same is
checked by scripts/gpu-check.sh on a GPU, not here.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from agent.demo import models as demo_models
from agent.models.backends import cuda
from agent.models.backends.base import BackendOptions, InferenceError, ModelLoadError, Session
from agent.models.backends.onnxruntime import OnnxRuntimeBackend, gpu_provider_options
from agent.models.backends.registry import get_backend
from agent.models.backends.tensorrt import TensorRTBackend, TensorRTOptions, TensorRTSession
from agent.models.engine_builder import BuildOptions, ShapeRange, build_engine
from agent.models.manager import ModelManager
from agent.models.warmup import warm_up
from agent.ops.metrics import AgentCollector, Gauges
from tests import fakes
from tests.fakes import FakeGPU, install, uninstall
from tests.fakes import tensorrt as fake_trt
from tests.fakes.pycuda import driver as fake_driver

RNG = np.random.default_rng(0)

fake_gpu = fakes.fake_gpu  # the fixture: fresh fakes in sys.modules per test


def build(tmp_path: Path, model: onnx.ModelProto, name: str = "m", **options: Any) -> Path:
    """ONNX as models/NAME/1/model.onnx, its engine built as version 2; the plan's path."""
    onnx_path = demo_models.save(model, tmp_path / "models" / name / "1" / "model.onnx")
    return build_engine(
        onnx_path,
        tmp_path / "models" / name,
        BuildOptions(cache_dir=tmp_path / "cache", progress=lambda line: None, **options),
    )


def load(plan: Path, **tensorrt: Any) -> TensorRTSession:
    return TensorRTBackend().load(plan, BackendOptions(extra={"tensorrt": tensorrt}))


def reference(model: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(demo_models.to_bytes(model), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, inputs), strict=True))


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    scale = max(float(np.max(np.abs(b))), 1e-12)
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) / scale


@pytest.fixture
def mlp_plan(fake_gpu: FakeGPU, tmp_path: Path) -> Path:
    return build(tmp_path, demo_models.mlp(), "mlp")


@pytest.fixture
def wrap_execute(monkeypatch: pytest.MonkeyPatch) -> Callable[[Callable[..., Any]], None]:
    """Wrap the fake IExecutionContext.execute_async_v3 with ``hook(context, handle)``."""

    def install_hook(hook: Callable[..., Any]) -> None:
        original = fake_trt.IExecutionContext.execute_async_v3

        def wrapped(self: Any, stream_handle: int) -> bool:
            result = hook(self, stream_handle)
            return original(self, stream_handle) if result is None else bool(result)

        monkeypatch.setattr(fake_trt.IExecutionContext, "execute_async_v3", wrapped)

    return install_hook


def run_threads(count: int, target: Callable[[int], None]) -> None:
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            target(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,), name=f"trt-test-{i}") for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]


# --------------------------------------------------------------------------- the fakes


def test_fake_tensorrt_has_no_binding_api_in_10(fake_gpu: FakeGPU, mlp_plan: Path) -> None:
    trt = __import__("tensorrt")
    runtime = trt.Runtime(trt.Logger())
    engine = runtime.deserialize_cuda_engine(mlp_plan.read_bytes())
    with pytest.raises(AttributeError):
        engine.get_binding_index("x")
    with pytest.raises(AttributeError):
        engine.num_bindings  # noqa: B018
    context = engine.create_execution_context()
    with pytest.raises(AttributeError):
        context.execute_async_v2([], 0)
    assert hasattr(trt, "IProgressMonitor")  # 10.x has it
    assert list(engine.get_tensor_shape("x")) == [-1, 16]
    assert list(context.get_tensor_shape("y")) == [-1, 8]  # unknown until the input is set
    assert context.infer_shapes() == ["x"]
    assert context.set_input_shape("x", (9, 16)) is False  # beyond the profile's max 8
    assert context.set_input_shape("x", (3, 16)) is True
    assert context.infer_shapes() == []
    assert list(context.get_tensor_shape("y")) == [3, 8]
    with pytest.raises(RuntimeError, match="Error in set optimization profile async"):
        context.set_optimization_profile_async(5, 0)
    assert runtime.deserialize_cuda_engine(b"not a plan") is None
    del context, engine


@pytest.mark.parametrize("fake_gpu", ["8.6.1"], indirect=True)
def test_fake_tensorrt_8_6_deprecates_the_binding_api(fake_gpu: FakeGPU, mlp_plan: Path) -> None:
    trt = __import__("tensorrt")
    engine = trt.Runtime(trt.Logger()).deserialize_cuda_engine(mlp_plan.read_bytes())
    with pytest.warns(DeprecationWarning), pytest.raises(NotImplementedError):
        engine.get_binding_index("x")
    assert not hasattr(trt, "IProgressMonitor")
    del engine


def test_fake_pycuda_needs_a_current_context_per_thread(fake_gpu: FakeGPU) -> None:
    drv = __import__("pycuda.driver", fromlist=["driver"])
    with pytest.raises(drv.LogicError, match="initialization error"):
        drv.Device(0)
    drv.init()
    context = drv.Device(0).retain_primary_context()
    with pytest.raises(drv.LogicError, match="no currently active context"):
        drv.mem_alloc(256)  # retained is not current
    context.push()
    allocation = drv.mem_alloc(1024)
    assert fake_gpu.device_bytes == 1024
    drv.Context.pop()

    failures: list[str] = []

    def elsewhere() -> None:
        try:
            drv.mem_alloc(16)
        except drv.LogicError as exc:
            failures.append(str(exc))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            allocation.free()  # not current here, and not this context's thread
        failures.extend(str(w.message) for w in caught)

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert "invalid device context" in failures[0]
    assert "could not be cleaned up" in failures[1]
    assert fake_gpu.device_bytes == 1024  # leaked: the pitfall the backend avoids
    with pytest.raises(drv.LogicError, match="cannot pop"):
        drv.Context.pop()
    context.detach()


def test_fake_streams_defer_work_until_synchronize(fake_gpu: FakeGPU) -> None:
    drv = fake_driver
    drv.init()
    context = drv.Device(0).retain_primary_context()
    context.push()
    try:
        stream = drv.Stream()
        device = drv.mem_alloc(64)
        host = drv.pagelocked_empty(16, np.float32)
        host[:] = 1.0
        drv.memcpy_htod_async(device, host, stream)
        back = drv.pagelocked_empty(16, np.float32)
        back[:] = 0.0
        drv.memcpy_dtoh_async(back, device, stream)
        assert not back.any()  # not yet: the copies are queued
        stream.synchronize()
        assert (back == 1.0).all()
        device.free()
        host.base.free()
        back.base.free()
        del stream
    finally:
        drv.Context.pop()
    context.detach()
    assert fake_gpu.device_bytes == 0 and fake_gpu.pinned_bytes == 0


# --------------------------------------------------------------------------- loading


def test_load_describes_the_engine(mlp_plan: Path) -> None:
    session = load(mlp_plan)
    try:
        assert isinstance(session, Session)
        assert [s.describe() for s in session.inputs] == ["x: float32[?,16]"]
        assert [s.describe() for s in session.outputs] == ["y: float32[?,8]"]
        assert session.inputs[0].shape == (None, 16)
        assert tuple(session.providers) == ("TensorRT",)
        assert session.profiles == ({"x": ((1, 16), (1, 16), (8, 16))},)
        assert session.contexts == 0  # created lazily, by the first caller
    finally:
        session.close()


def test_registry_finds_the_backend(fake_gpu: FakeGPU) -> None:
    assert isinstance(get_backend("tensorrt"), TensorRTBackend)


@pytest.mark.parametrize(
    ("module", "hint"), [("tensorrt", "python3-libnvinfer"), ("pycuda", "pip install pycuda")]
)
def test_missing_runtime_is_a_load_error_with_a_hint(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, module: str, hint: str
) -> None:
    install(monkeypatch, **{module: False})
    try:
        plan = tmp_path / "model.plan"
        plan.write_bytes(b"x" * 64)
        with pytest.raises(ModelLoadError, match=hint):
            TensorRTBackend().load(plan, BackendOptions())
    finally:
        uninstall()


def test_bad_plan_fails_with_the_loggers_message(fake_gpu: FakeGPU, tmp_path: Path) -> None:
    plan = tmp_path / "model.plan"
    plan.write_bytes(b"definitely not an engine" * 10)
    with pytest.raises(ModelLoadError, match="Magic tag does not match") as info:
        TensorRTBackend().load(plan, BackendOptions())
    assert "Engine deserialization failed" in str(info.value)
    assert "TensorRT version and GPU it was built for" in str(info.value)
    assert fake_gpu.device_bytes == 0


def test_plan_from_another_version_or_gpu_is_refused(
    fake_gpu: FakeGPU, mlp_plan: Path, tmp_path: Path
) -> None:
    data = mlp_plan.read_bytes()
    other_version = tmp_path / "old.plan"
    other_version.write_bytes(data[:4] + (232).to_bytes(4, "little") + data[8:])
    with pytest.raises(ModelLoadError, match="Version tag does not match"):
        load(other_version)
    other_gpu = tmp_path / "other-gpu.plan"
    other_gpu.write_bytes(
        data.replace(b'"compute_capability": [8, 7]', b'"compute_capability": [7, 2]')
    )
    with pytest.raises(
        ModelLoadError, match=r"incompatible device, expecting compute 8\.7 got compute 7\.2"
    ):
        load(other_gpu)
    assert fake_gpu.live("trt-engine") == []


def test_unknown_backend_options_are_refused(mlp_plan: Path) -> None:
    with pytest.raises(ModelLoadError, match="unknown tensorrt option"):
        load(mlp_plan, zero_kopy=True)
    with pytest.raises(ModelLoadError, match="zero_copy must be true or false"):
        load(mlp_plan, zero_copy="yes")
    assert TensorRTOptions.from_extra({}) == TensorRTOptions()


# --------------------------------------------------------------------------- running


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_outputs_match_onnx_runtime(mlp_plan: Path, batch: int) -> None:
    session = load(mlp_plan)
    try:
        x = RNG.standard_normal((batch, 16)).astype(np.float32)
        y = session.run({"x": x})["y"]
        assert y.shape == (batch, 8) and y.dtype == np.float32
        assert rel_err(y, reference(demo_models.mlp(), {"x": x})["y"]) < 1e-6
    finally:
        session.close()


def test_results_are_copies_not_views_of_reused_buffers(mlp_plan: Path) -> None:
    session = load(mlp_plan)
    try:
        first = session.run({"x": np.ones((2, 16), np.float32)})["y"]
        kept = first.copy()
        session.run({"x": np.full((2, 16), -3.0, np.float32)})
        np.testing.assert_array_equal(first, kept)
    finally:
        session.close()


def test_decoder_and_conv_net_run_through_warm_up(fake_gpu: FakeGPU, tmp_path: Path) -> None:
    for name, model, feed in [
        (
            "decoder",
            demo_models.gru_decoder(),
            {"token": np.array([[3], [5]], np.int64), "h": np.zeros((2, 32), np.float32)},
        ),
        (
            "conv",
            demo_models.conv_net(),
            {"image": RNG.standard_normal((2, 3, 32, 32)).astype(np.float32)},
        ),
    ]:
        session = load(build(tmp_path, model, name))
        try:
            warm_up(session)
            outputs = session.run(feed)
            expected = reference(model, feed)
            assert set(outputs) == set(expected)
            for key, value in expected.items():
                assert outputs[key].dtype == value.dtype
                assert rel_err(outputs[key], value) < 1e-5, key
        finally:
            session.close()


@pytest.mark.parametrize("fake_gpu", ["8.6.1"], indirect=True)
def test_tensorrt_8_6_engines_take_int32_where_onnx_had_int64(
    fake_gpu: FakeGPU, tmp_path: Path
) -> None:
    session = load(build(tmp_path, demo_models.gru_decoder(), "decoder"))
    try:
        token = next(s for s in session.inputs if s.name == "token")
        assert token.dtype == np.int32  # TensorRT 8.x casts INT64 I/O down to INT32
        out = session.run({"token": np.array([[3]], np.int32), "h": np.zeros((1, 32), np.float32)})
        ref = reference(
            demo_models.gru_decoder(),
            {"token": np.array([[3]], np.int64), "h": np.zeros((1, 32), np.float32)},
        )
        assert int(out["next_token"][0, 0]) == int(ref["next_token"][0, 0])
    finally:
        session.close()


def test_wrong_inputs_are_inference_errors(mlp_plan: Path) -> None:
    session = load(mlp_plan)
    try:
        cases = [
            ({}, "missing input"),
            ({"x": np.zeros((1, 16), np.float32), "z": np.zeros(1)}, "unknown input"),
            ({"x": np.zeros((1, 16), np.float64)}, "float64, the engine takes float32"),
            ({"x": np.zeros((1, 17), np.float32)}, r"shape \[1, 17\], the engine takes \[-1, 16\]"),
            ({"x": np.zeros((16,), np.float32)}, "shape"),
            (
                {"x": np.zeros((9, 16), np.float32)},
                r"fit no optimization profile \(profile 0: x \[1, 16\]..\[8, 16\]\)",
            ),
        ]
        for inputs, message in cases:
            with pytest.raises(InferenceError, match=message):
                session.run(inputs)
        assert session.run({"x": np.zeros((8, 16), np.float32)})["y"].shape == (8, 8)  # still fine
    finally:
        session.close()


def test_a_failed_execute_reports_what_tensorrt_logged(
    mlp_plan: Path, wrap_execute: Callable[[Callable[..., Any]], None]
) -> None:
    def refuse(context: Any, handle: int) -> bool:
        fake_trt._error(1, "Cuda Runtime", "enqueue", "the launch timed out and was terminated")
        return False

    session = load(mlp_plan)
    try:
        wrap_execute(refuse)
        with pytest.raises(InferenceError, match=r"execute_async_v3 failed: .*launch timed out"):
            session.run({"x": np.zeros((1, 16), np.float32)})
        assert session.contexts == 1  # refused before launch: the context stays usable
    finally:
        session.close()


def test_several_profiles_are_chosen_per_request(fake_gpu: FakeGPU, tmp_path: Path) -> None:
    small = {"x": ShapeRange((1, 16), (2, 16), (4, 16))}
    large = {"x": ShapeRange((5, 16), (8, 16), (16, 16))}
    session = load(build(tmp_path, demo_models.mlp(), "mlp", profiles=(small, large)))
    try:
        assert [p["x"][2] for p in session.profiles] == [(4, 16), (16, 16)]
        for batch in (2, 12, 3, 16, 1):
            x = RNG.standard_normal((batch, 16)).astype(np.float32)
            assert (
                rel_err(session.run({"x": x})["y"], reference(demo_models.mlp(), {"x": x})["y"])
                < 1e-6
            )
        used = [e.details["profile"] for e in fake_gpu.events if e.name == "enqueue"]
        assert used == [0, 1, 0, 1, 0]
        assert session.contexts == 1  # one context switching profiles, buffers sized for 16
        with pytest.raises(InferenceError, match="fit no optimization profile"):
            session.run({"x": np.zeros((17, 16), np.float32)})
    finally:
        session.close()


# --------------------------------------------------------------------------- threads


def test_concurrent_callers_get_their_own_context_and_stream(
    mlp_plan: Path, wrap_execute: Callable[[Callable[..., Any]], None]
) -> None:
    workers = 4
    barrier = threading.Barrier(workers, timeout=10)
    seen: dict[str, tuple[int, int]] = {}

    def rendezvous(context: Any, handle: int) -> None:
        seen[threading.current_thread().name] = (id(context), handle)
        barrier.wait()  # all four are inside execute at once

    session = load(mlp_plan)
    try:
        warm_up(session)  # the loading thread's context; the first worker inherits it
        wrap_execute(rendezvous)

        def work(i: int) -> None:
            x = np.full((i + 1, 16), float(i), np.float32)
            y = session.run({"x": x})["y"]
            assert rel_err(y, reference(demo_models.mlp(), {"x": x})["y"]) < 1e-6

        run_threads(workers, work)
        assert session.contexts == workers
        assert len({c for c, _ in seen.values()}) == workers
        assert len({h for _, h in seen.values()}) == workers  # one stream per thread
    finally:
        session.close()


def test_a_thread_keeps_its_context(mlp_plan: Path) -> None:
    session = load(mlp_plan)
    try:
        for _ in range(5):
            session.run({"x": np.zeros((1, 16), np.float32)})
        run_threads(
            1, lambda i: [session.run({"x": np.zeros((2, 16), np.float32)}) for _ in range(3)]
        )
        assert session.contexts == 1  # sequential callers share the idle context
    finally:
        session.close()


@pytest.mark.parametrize("fake_gpu", ["8.5.3"], indirect=True)
def test_tensorrt_8_5_lets_a_profile_serve_one_context(
    fake_gpu: FakeGPU, tmp_path: Path, wrap_execute: Callable[[Callable[..., Any]], None]
) -> None:
    session = load(build(tmp_path, demo_models.mlp(), "mlp"))
    inside, release = threading.Event(), threading.Event()

    def hold(context: Any, handle: int) -> None:
        if threading.current_thread().name == "trt-test-0":
            inside.set()
            release.wait(10)

    try:
        wrap_execute(hold)
        errors: list[str] = []

        def work(i: int) -> None:
            if i == 1:
                inside.wait(10)
                try:
                    session.run({"x": np.zeros((1, 16), np.float32)})
                except InferenceError as exc:
                    errors.append(str(exc))
                release.set()
            else:
                session.run({"x": np.zeros((1, 16), np.float32)})

        run_threads(2, work)
        assert errors and "one context use a profile at a time" in errors[0]
    finally:
        session.close()


# --------------------------------------------------------------------------- teardown


def test_close_releases_contexts_then_engine_then_buffers_in_context(
    fake_gpu: FakeGPU, mlp_plan: Path
) -> None:
    baseline = fake_gpu.device_bytes
    session = load(mlp_plan)
    run_threads(2, lambda i: session.run({"x": np.zeros((1, 16), np.float32)}))
    start = len(fake_gpu.events)
    closer = threading.Thread(target=session.close, name="closer")  # not a loading/worker thread
    closer.start()
    closer.join()
    tail = [e for e in fake_gpu.events[start:] if e.name != "alloc"]
    names = [e.name if e.name != "free" else f"free:{e.details['kind']}" for e in tail]
    contexts = [i for i, n in enumerate(names) if n == "trt_context_destroyed"]
    engine = names.index("trt_engine_destroyed")
    buffers = [i for i, n in enumerate(names) if n in ("free:device", "free:pinned")]
    assert contexts  # one per concurrent caller, 1 or 2 here
    assert max(contexts) < engine < min(buffers)
    assert all(e.cuda_current for e in tail), [e.name for e in tail if not e.cuda_current]
    assert fake_gpu.device_bytes == baseline and fake_gpu.pinned_bytes == 0
    assert "leak" not in fake_gpu.names()
    with pytest.raises(InferenceError, match="session closed"):
        session.run({"x": np.zeros((1, 16), np.float32)})
    session.close()  # idempotent


def test_close_during_a_run_waits_for_it(
    fake_gpu: FakeGPU, mlp_plan: Path, wrap_execute: Callable[[Callable[..., Any]], None]
) -> None:
    session = load(mlp_plan)
    inside, release = threading.Event(), threading.Event()

    def hold(context: Any, handle: int) -> None:
        inside.set()
        release.wait(10)

    wrap_execute(hold)
    results: list[np.ndarray] = []
    thread = threading.Thread(
        target=lambda: results.append(session.run({"x": np.ones((1, 16), np.float32)})["y"])
    )
    thread.start()
    assert inside.wait(10)
    session.close()
    assert session.closed and fake_gpu.live("trt-engine")  # still running: nothing freed yet
    release.set()
    thread.join(10)
    assert results and results[0].shape == (1, 8)
    assert fake_gpu.device_bytes == 0 and fake_gpu.pinned_bytes == 0


def test_fifty_swaps_return_device_memory_to_baseline(fake_gpu: FakeGPU, tmp_path: Path) -> None:
    plans = [build(tmp_path, demo_models.mlp(seed=s), f"m{s}") for s in range(2)]
    session = load(plans[0])
    session.run({"x": np.zeros((1, 16), np.float32)})
    session.close()
    baseline = (fake_gpu.device_bytes, fake_gpu.pinned_bytes, fake_gpu.stream_count)
    peak = 0
    for cycle in range(50):
        session = load(plans[cycle % 2])
        run_threads(2, lambda i, s=session: s.run({"x": np.ones((i + 1, 16), np.float32)}))
        with pytest.raises(InferenceError):
            session.run({"x": np.zeros((1, 3), np.float32)})  # a failed run must not pin memory
        peak = max(peak, fake_gpu.device_bytes)
        session.close()
    assert peak > baseline[0]
    assert (fake_gpu.device_bytes, fake_gpu.pinned_bytes) == baseline[:2]
    assert fake_gpu.stream_count <= baseline[2] + 2  # per-thread streams, not per session
    assert "leak" not in fake_gpu.names()


def test_zero_copy_uses_mapped_host_buffers(fake_gpu: FakeGPU, mlp_plan: Path) -> None:
    session = load(mlp_plan, zero_copy=True)
    try:
        x = RNG.standard_normal((4, 16)).astype(np.float32)
        assert (
            rel_err(session.run({"x": x})["y"], reference(demo_models.mlp(), {"x": x})["y"]) < 1e-6
        )
        assert fake_gpu.live("device") == [] and fake_gpu.live("mapped")
        assert session.device_bytes == 0
    finally:
        session.close()
    assert fake_gpu.pinned_bytes == 0


def test_a_contexts_buffers_grow_with_its_runs_and_are_then_reused(
    fake_gpu: FakeGPU, mlp_plan: Path
) -> None:
    """A context's staging buffers are made by the first run and grown by a larger one, not
    sized up front for the profile's largest batch; runs that fit allocate nothing."""
    session = load(mlp_plan)
    try:
        largest = session.profiles[0]["x"][2][0]
        sizes = {}
        for batch in (1, largest):
            x = RNG.standard_normal((batch, 16)).astype(np.float32)
            y = session.run({"x": x})["y"]
            assert rel_err(y, reference(demo_models.mlp(), {"x": x})["y"]) < 1e-6
            sizes[batch] = sorted(r.nbytes for r in fake_gpu.live("pinned"))
        assert sizes[1] == [256, 256]  # x [1, 16] and y [1, 8] float32, one size class
        assert sizes[largest] == sorted(cuda.size_class(n * largest * 4) for n in (16, 8))
        allocations = fake_gpu.names("alloc").count("alloc")
        held = session.device_bytes
        for batch in (1, largest, 2):
            session.run({"x": np.ones((batch, 16), np.float32)})
        assert fake_gpu.names("alloc").count("alloc") == allocations
        assert session.device_bytes == held
    finally:
        session.close()
    assert fake_gpu.pinned_bytes == 0


def test_a_run_the_device_has_no_memory_for_is_refused_and_the_next_runs(
    fake_gpu: FakeGPU, mlp_plan: Path
) -> None:
    session = load(mlp_plan)
    try:
        small = np.ones((1, 16), np.float32)
        session.run({"x": small})
        largest = session.profiles[0]["x"][2][0]
        fake_gpu.total_memory = fake_gpu.device_bytes  # no room to grow a buffer
        with pytest.raises(InferenceError, match=r"no device memory for (in|out)put '[xy]'"):
            session.run({"x": np.ones((largest, 16), np.float32)})
        np.testing.assert_array_equal(
            session.run({"x": small})["y"], session.run({"x": small})["y"]
        )
        assert session.contexts == 1  # the context was kept, not discarded
        fake_gpu.total_memory = 8 * 1024**3
        assert session.run({"x": np.ones((largest, 16), np.float32)})["y"].shape == (largest, 8)
    finally:
        session.close()
    assert fake_gpu.pinned_bytes == 0 and fake_gpu.live("device") == []


def test_a_buffer_far_larger_than_the_recent_runs_asked_is_made_again_smaller(
    fake_gpu: FakeGPU,
) -> None:
    """One long prompt does not hold its logits buffer for the context's life: a look every
    TRIM_AFTER_S frees a buffer more than twice what the runs since the last look asked."""
    device = cuda.get_device()
    now = [0.0]
    with device.activate():
        pool = cuda.BufferPool(device.driver, mapped=False, clock=lambda: now[0])
        try:
            pool.fit("logits", 1_000_000, 4_000_000)  # a long prompt
            pool.fit("ids", 1_000, 4_000)
            for when, logits in ((1.0, 10_000), (cuda.TRIM_AFTER_S, 10_000)):
                now[0] = when
                pool.fit("logits", logits, 4_000_000)  # short prompts since
                pool.fit("ids", 1_000, 4_000)
                pool.trim()
                assert pool["logits"].nbytes >= 1_000_000  # asked within the last look's time
            now[0] = 2 * cuda.TRIM_AFTER_S - 1
            pool.fit("logits", 10_000, 4_000_000)
            pool.fit("ids", 1_000, 4_000)
            pool.trim()  # not yet: the last look was less than TRIM_AFTER_S ago
            assert pool["logits"].nbytes >= 1_000_000
            now[0] = 2 * cuda.TRIM_AFTER_S
            pool.trim()
            assert len(pool) == 1 and pool["ids"].nbytes == cuda.size_class(1_000)
            assert pool.fit("logits", 10_000, 4_000_000).nbytes == cuda.size_class(10_000)
            assert pool.device_bytes == cuda.size_class(10_000) + cuda.size_class(1_000)
        finally:
            pool.free_all()
    assert fake_gpu.device_bytes == 0 and fake_gpu.pinned_bytes == 0


def test_a_pools_bytes_may_be_read_while_its_run_changes_its_buffers(
    fake_gpu: FakeGPU, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A metrics scrape reads `device_bytes` on its own thread while a worker's runs make,
    grow and free buffers: it never sees the buffers' table change under it."""
    monkeypatch.setattr(cuda, "TRIM_AFTER_S", 0.0)
    device = cuda.get_device()
    with device.activate():
        pool = cuda.BufferPool(device.driver, mapped=False)
    stop = threading.Event()

    def runs() -> None:
        with device.activate():
            step = 0
            while not stop.is_set():
                pool.fit(f"t{step % 50}", 1000 + step, 10**7)
                if step % 50 == 49:
                    pool.trim()
                step += 1

    worker = threading.Thread(target=runs, name="test-runs")
    worker.start()
    try:
        for _ in range(20_000):
            assert pool.device_bytes >= 0 and pool.host_bytes >= 0
    finally:
        stop.set()
        worker.join()
        with device.activate():
            pool.free_all()


def test_a_run_trims_after_its_outputs_are_read(
    fake_gpu: FakeGPU, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a look after every run, a small batch after a large one still reads its results
    out of the buffers the look then frees (freed page-locked memory reads as garbage in the
    fake), and the buffers follow the batch."""
    monkeypatch.setattr(cuda, "TRIM_AFTER_S", 0.0)
    model = demo_models.conv_net(classes=2048)  # scores: 8 KiB an image
    session = load(build(tmp_path, model, "conv"))
    try:
        for batch in (8, 1, 8, 1):
            feed = {"image": RNG.standard_normal((batch, 3, 32, 32)).astype(np.float32)}
            outputs = session.run(feed)
            for key, value in reference(model, feed).items():
                assert rel_err(outputs[key], value) < 1e-5, (batch, key)
            staged = max((r.nbytes for r in fake_gpu.live("pinned")), default=0)
            if batch == 8:
                assert staged == cuda.size_class(8 * 3 * 32 * 32 * 4)
            else:
                assert staged <= 2 * cuda.size_class(3 * 32 * 32 * 4)
    finally:
        session.close()


def test_buffer_pool_frees_only_with_the_context_current(fake_gpu: FakeGPU) -> None:
    device = cuda.get_device()
    with device.activate():
        pool = device.buffer_pool()
        buffer = pool.fit("t", 1000, 1000)
        assert buffer.nbytes == 1024 and pool.device_bytes == 1024 and pool.host_bytes == 1024
    done = threading.Event()

    def free_elsewhere() -> None:
        with device.activate():  # the rule: push in whatever thread frees
            pool.free_all()
        done.set()

    threading.Thread(target=free_elsewhere).start()
    assert done.wait(10)
    assert (
        fake_gpu.device_bytes == 0 and fake_gpu.pinned_bytes == 0 and "leak" not in fake_gpu.names()
    )
    assert device.identity.slug == "orin-fake-sm87" and device.identity.integrated


# --------------------------------------------------------------------------- the agent


def write_plan_version(mm: ModelManager, model_dir: Path, number: int, plan: bytes) -> None:
    """A version folder as a deployment tool makes it: complete when it appears."""
    folder = model_dir / str(number)
    folder.mkdir(parents=True)
    (folder / "model.plan").write_bytes(plan)
    mm.mark_complete(folder)


@pytest.fixture
def manager(
    fake_gpu: FakeGPU, tmp_path: Path
) -> Iterator[tuple[ModelManager, list[dict[str, Any]]]]:
    events: list[dict[str, Any]] = []
    root = tmp_path / "repo"
    root.mkdir()
    mm = ModelManager(root, BackendOptions(), on_event=events.append)
    yield mm, events
    mm.close(drain_timeout=1)


def test_model_manager_swaps_engines_and_keeps_serving_on_a_bad_plan(
    fake_gpu: FakeGPU, tmp_path: Path, manager: tuple[ModelManager, list[dict[str, Any]]]
) -> None:
    mm, events = manager
    plans = [build(tmp_path, demo_models.mlp(seed=s), f"src{s}").read_bytes() for s in range(2)]
    model_dir = tmp_path / "repo" / "mlp"
    model_dir.mkdir()
    (model_dir / "config.toml").write_text("[policy]\nkeep_loaded = 0\n")
    write_plan_version(mm, model_dir, 1, plans[0])
    mm.sync()
    with mm.lease("mlp") as lease:
        assert lease.loaded.version == 1 and lease.loaded.backend == "tensorrt"
        lease.session.run({"x": np.zeros((2, 16), np.float32)})
    write_plan_version(mm, model_dir, 2, plans[1])
    mm.sync()
    assert mm.inventory()["models"]["mlp"]["serving"] == 2
    assert len(fake_gpu.live("trt-engine")) == 1  # v1 was released on the swap
    write_plan_version(mm, model_dir, 3, b"\x00garbage plan from another box")
    mm.sync()
    inventory = mm.inventory()["models"]["mlp"]
    assert inventory["serving"] == 2 and inventory["versions"]["3"]["state"] == "failed"
    assert "Magic tag does not match" in inventory["versions"]["3"]["error"]
    failed = [e for e in events if e["type"] == "model_load_failed"]
    assert failed and "deserialize" in failed[0]["error"]

    def request(i: int) -> None:
        with mm.lease("mlp") as lease:
            lease.session.run({"x": np.zeros((i + 1, 16), np.float32)})

    run_threads(3, request)


def test_the_gpu_memory_of_each_loaded_engine_is_a_metric(
    fake_gpu: FakeGPU, tmp_path: Path, manager: tuple[ModelManager, list[dict[str, Any]]]
) -> None:
    """`edge_agent_model_device_bytes{model, version}`: what each loaded version's session
    holds, read at scrape time, so an operator sees it follow the requests."""
    mm, _ = manager
    model_dir = tmp_path / "repo" / "conv"
    model_dir.mkdir()
    write_plan_version(
        mm, model_dir, 1, build(tmp_path, demo_models.conv_net(), "src").read_bytes()
    )
    mm.sync()
    scrape = AgentCollector(lambda: Gauges(device_bytes=mm.device_bytes()))

    def scraped() -> dict[tuple[str, str], float]:
        (family,) = [f for f in scrape.collect() if f.name == "edge_agent_model_device_bytes"]
        return {(s.labels["model"], s.labels["version"]): s.value for s in family.samples}

    with mm.lease("conv") as lease:
        lease.session.run({"image": np.zeros((1, 3, 32, 32), np.float32)})
        one = scraped()[("conv", "1")]
        lease.session.run({"image": np.zeros((8, 3, 32, 32), np.float32)})
        eight = scraped()[("conv", "1")]
        assert 0 < one < eight == lease.session.device_bytes
    assert mm.device_bytes() == {("conv", 1): eight}


def test_an_idle_session_gives_its_buffers_back_and_runs_again(
    fake_gpu: FakeGPU, mlp_plan: Path, wrap_execute: Callable[[Callable[..., Any]], None]
) -> None:
    """After `IDLE_RELEASE_S` without a run, a session frees its contexts' staging buffers
    (device and page-locked); never under a run, never sooner; the next run makes them
    again and answers as before."""
    session = load(mlp_plan)
    try:
        x = RNG.standard_normal((8, 16)).astype(np.float32)
        expected = session.run({"x": x})["y"]
        held = session.device_bytes
        pinned = fake_gpu.pinned_bytes
        assert held and pinned
        assert session.release_idle() == 0  # the last run ended just now
        assert session.device_bytes == held and fake_gpu.pinned_bytes == pinned

        inside, release = threading.Event(), threading.Event()

        def hold(context: Any, handle: int) -> None:
            inside.set()
            release.wait(10)

        wrap_execute(hold)
        thread = threading.Thread(target=lambda: session.run({"x": x}))
        thread.start()
        assert inside.wait(10)
        assert session.release_idle(idle_s=0) == 0  # a run is in flight: nothing is freed
        release.set()
        thread.join(10)

        assert session.release_idle(idle_s=0) == held + pinned
        assert session.device_bytes == 0 and fake_gpu.pinned_bytes == 0
        assert fake_gpu.live("device") == []
        assert session.release_idle(idle_s=0) == 0  # nothing left to give back
        np.testing.assert_array_equal(session.run({"x": x})["y"], expected)
        assert session.device_bytes == held and session.contexts == 1
    finally:
        session.close()
    assert fake_gpu.pinned_bytes == 0


def test_the_manager_has_idle_engines_give_their_buffers_back(
    fake_gpu: FakeGPU,
    tmp_path: Path,
    manager: tuple[ModelManager, list[dict[str, Any]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every sync of the repository (the watcher's rescan, every 30 s by default) asks the
    loaded sessions to release what they keep while idle: the metric falls to 0."""
    from agent.models.backends import base

    mm, _ = manager
    model_dir = tmp_path / "repo" / "mlp"
    model_dir.mkdir()
    write_plan_version(mm, model_dir, 1, build(tmp_path, demo_models.mlp(), "src").read_bytes())
    mm.sync()
    with mm.lease("mlp") as lease:
        lease.session.run({"x": np.zeros((8, 16), np.float32)})
    held = mm.device_bytes()[("mlp", 1)]
    mm.sync()
    assert held and mm.device_bytes() == {("mlp", 1): held}  # not idle long enough
    monkeypatch.setattr(base, "IDLE_RELEASE_S", 0.0)
    mm.sync()
    assert mm.device_bytes() == {("mlp", 1): 0} and fake_gpu.pinned_bytes == 0
    with mm.lease("mlp") as lease:
        assert lease.session.run({"x": np.zeros((2, 16), np.float32)})["y"].shape == (2, 8)


# --------------------------------------------------------------------------- ONNX Runtime on GPU


def test_gpu_options_become_execution_provider_options() -> None:
    options = gpu_provider_options(
        {
            "gpu": {
                "engine_cache_path": "/var/cache/trt",
                "fp16": True,
                "workspace_bytes": 1 << 30,
                "device_id": 0,
                "timing_cache": True,
            }
        }
    )
    assert options["TensorrtExecutionProvider"] == {
        "device_id": "0",
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": "/var/cache/trt",
        "trt_timing_cache_enable": "True",
        "trt_timing_cache_path": "/var/cache/trt",
        "trt_fp16_enable": "True",
        "trt_max_workspace_size": str(1 << 30),
    }
    assert options["CUDAExecutionProvider"] == {"device_id": "0"}
    for bad, message in [
        ({"fp61": True}, "unknown gpu option"),
        ({"fp16": "yes"}, "fp16 must be true or false"),
        ({"workspace_bytes": -1}, "workspace_bytes must be an integer"),
        ({"timing_cache": True}, "needs gpu.engine_cache_path"),
    ]:
        with pytest.raises(ModelLoadError, match=message):
            gpu_provider_options({"gpu": bad})


def test_gpu_providers_fall_back_to_cpu_with_their_options(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = demo_models.save(demo_models.mlp(), tmp_path / "model.onnx")
    options = BackendOptions(
        providers=("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"),
        extra={
            "gpu": {"engine_cache_path": str(tmp_path / "trt"), "fp16": True},
            "provider_options": {"TensorrtExecutionProvider": {"trt_fp16_enable": "False"}},
        },
    )
    with caplog.at_level("WARNING", logger="agent.models.backends.onnxruntime"):
        session = OnnxRuntimeBackend().load(path, options)
    assert tuple(session.providers) == ("CPUExecutionProvider",)  # no GPU build here
    warned = [r.getMessage() for r in caplog.records]
    assert any("TensorrtExecutionProvider is not available" in w for w in warned)
    assert any("CUDAExecutionProvider is not available" in w for w in warned)
