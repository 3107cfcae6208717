#!/usr/bin/env python3
"""The TensorRT path on a real GPU, in one prepared run. Installs nothing, downloads nothing.

Where ``tensorrt`` is importable it: builds engines from the demo ONNX models with the
agent's builder (and again, to see the cache hit), runs them through the agent's TensorRT
backend and compares with ONNX Runtime on the CPU (relative error < 1e-3 in FP32), runs
from several threads at once, swaps engines N times and reports device memory before and
after, tries zero-copy buffers and FP16, and tries ONNX Runtime's GPU providers if present.

Every check ends as PASS, FAIL or SKIP with the reason; the exit status is 1 if any check
failed, else 0 (so a machine without TensorRT exits 0, having said what it skipped).
``--json FILE`` writes the same results for a machine to read.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.demo import models as demo_models
from agent.models.backends.base import BackendOptions

MIB = 1024 * 1024
GENAI_INT4_FILE = "qwen2-cpu-int4-rtn-block-32-acc-level-4.onnx"  # tests/fixtures/real/genai


@dataclass
class Check:
    name: str
    status: str  # PASS, FAIL, SKIP
    detail: str
    data: dict[str, Any] = field(default_factory=dict)


class Report:
    def __init__(self) -> None:
        self.checks: list[Check] = []
        self.facts: dict[str, Any] = {}

    def add(self, name: str, status: str, detail: str, **data: Any) -> None:
        self.checks.append(Check(name, status, detail, data))
        print(f"[{status}] {name}: {detail}", flush=True)

    def run(self, name: str, body: Callable[[], tuple[str, str, dict[str, Any]]]) -> None:
        """Run one check; an exception is a FAIL with its message, never an abort."""
        try:
            status, detail, data = body()
        except Exception as exc:
            status, detail, data = "FAIL", f"{type(exc).__name__}: {exc}", {}
            traceback.print_exc()
        self.add(name, status, detail, **data)

    @property
    def failed(self) -> bool:
        return any(c.status == "FAIL" for c in self.checks)

    def summary(self) -> None:
        print("\n== summary ==")
        for c in self.checks:
            print(f"{c.status:4}  {c.name:28} {c.detail}")
        counts = {s: sum(c.status == s for c in self.checks) for s in ("PASS", "FAIL", "SKIP")}
        print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")

    def write(self, path: Path | None) -> None:
        if path is not None:
            payload = {"facts": self.facts, "checks": [asdict(c) for c in self.checks]}
            path.write_text(json.dumps(payload, indent=2, default=str) + "\n")


def rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    scale = max(float(np.max(np.abs(expected))), 1e-12)
    diff = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
    return float(np.max(diff)) / scale


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


MODELS: dict[str, Callable[[], Any]] = {
    "mlp": demo_models.mlp,
    "conv": demo_models.conv_net,
    "decoder": demo_models.gru_decoder,
}


def example_inputs(
    name: str, batch: int, rng: np.random.Generator, int32: bool
) -> dict[str, np.ndarray]:
    if name == "mlp":
        return {"x": rng.standard_normal((batch, 16)).astype(np.float32)}
    if name == "conv":
        return {"image": rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)}
    token = rng.integers(1, 32, size=(batch, 1)).astype(np.int32 if int32 else np.int64)
    return {"token": token, "h": rng.standard_normal((batch, 32)).astype(np.float32) * 0.1}


class GpuCheck:
    def __init__(self, args: argparse.Namespace, report: Report) -> None:
        self.args = args
        self.report = report
        self._root = Path(args.workdir) if args.workdir else None
        self.plans: dict[str, Path] = {}
        self.ort: Any = None
        self.rng = np.random.default_rng(0)

    @property
    def root(self) -> Path:
        """The work folder, made on first use (a skipped run leaves nothing behind)."""
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="gpu-check-"))
            print(f"gpu-check: work folder {self._root}", flush=True)
        return self._root

    @property
    def repo(self) -> Path:
        return self.root / "models"

    @property
    def cache(self) -> Path:
        return self.root / "engine-cache"

    # -- environment --------------------------------------------------------------------

    def environment(self) -> bool:
        """False when nothing GPU-side can run (and that was reported)."""
        r = self.report
        r.facts.update(
            python=sys.version.split()[0], platform=platform.platform(), machine=platform.machine()
        )
        try:
            import tensorrt as trt
        except ImportError as exc:
            r.add("tensorrt", "SKIP", f"tensorrt not importable: skipped ({exc})")
            return False
        r.facts["tensorrt"] = trt.__version__
        r.add("tensorrt", "PASS", f"tensorrt {trt.__version__} from {Path(trt.__file__).parent}")
        try:
            import onnxruntime as ort

            self.ort = ort
            r.facts["onnxruntime"] = ort.__version__
            r.facts["ort_providers"] = ort.get_available_providers()
        except ImportError as exc:
            r.add("onnxruntime", "SKIP", f"onnxruntime not importable: comparisons skipped ({exc})")
        try:
            from agent.models.backends import cuda

            device = cuda.get_device(self.args.device)
        except Exception as exc:
            r.add("cuda", "FAIL", f"pycuda/CUDA not usable, the backend cannot run: {exc}")
            return True  # the builder may still work without pycuda
        free, total = device.mem_get_info()
        ident = device.identity
        r.facts["gpu"] = {
            "name": ident.name,
            "compute_capability": list(ident.compute_capability),
            "integrated": ident.integrated,
            "total_mib": round(total / MIB),
        }
        r.add(
            "cuda",
            "PASS",
            f"{ident.name} sm{ident.compute_capability[0]}{ident.compute_capability[1]}, "
            f"{'integrated' if ident.integrated else 'discrete'}, "
            f"{free // MIB} of {total // MIB} MiB free",
        )
        return True

    # -- checks --------------------------------------------------------------------------

    def build(self) -> tuple[str, str, dict[str, Any]]:
        from agent.models.engine_builder import BuildOptions, build_engine

        seconds: dict[str, float] = {}
        for name, make in MODELS.items():
            onnx = demo_models.save(make(), self.repo / name / "1" / "model.onnx")
            started = time.monotonic()
            self.plans[name] = build_engine(
                onnx, self.repo / name, BuildOptions(cache_dir=self.cache, device=self.args.device)
            )
            seconds[name] = round(time.monotonic() - started, 2)
        detail = ", ".join(f"{n} {s} s" for n, s in seconds.items())
        return "PASS", f"built {detail}", {"seconds": seconds}

    def cache_hit(self) -> tuple[str, str, dict[str, Any]]:
        from agent.models.engine_builder import BuildOptions, build_engine

        if "mlp" not in self.plans:
            return "SKIP", "no engine was built", {}
        started = time.monotonic()
        again = build_engine(
            self.repo / "mlp" / "1" / "model.onnx",
            self.repo / "mlp",
            BuildOptions(cache_dir=self.cache, device=self.args.device),
        )
        took = time.monotonic() - started
        ok = again == self.plans["mlp"]
        return (
            ("PASS" if ok else "FAIL"),
            f"second build returned {again.parent.name}/ in {took:.2f} s",
            {},
        )

    def _session(self, name: str, **tensorrt: Any) -> Any:
        from agent.models.backends.tensorrt import TensorRTBackend

        return TensorRTBackend().load(
            self.plans[name], BackendOptions(extra={"tensorrt": tensorrt})
        )

    def _reference(self, name: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        session = self.ort.InferenceSession(
            str(self.repo / name / "1" / "model.onnx"), providers=["CPUExecutionProvider"]
        )
        feed = {k: (v.astype(np.int64) if v.dtype == np.int32 else v) for k, v in inputs.items()}
        names = [o.name for o in session.get_outputs()]
        return dict(zip(names, session.run(names, feed), strict=True))

    def compare(self, name: str, **tensorrt: Any) -> tuple[str, str, dict[str, Any]]:
        if name not in self.plans or self.ort is None:
            return "SKIP", "needs a built engine and onnxruntime", {}
        session = self._session(name, **tensorrt)
        try:
            int32 = any(s.dtype == np.int32 for s in session.inputs)
            worst, tokens_same = 0.0, True
            for batch in (1, 4, 8):
                inputs = example_inputs(name, batch, self.rng, int32)
                got = session.run(inputs)
                want = self._reference(name, inputs)
                for key, value in want.items():
                    if np.issubdtype(value.dtype, np.integer):
                        tokens_same &= bool(np.array_equal(got[key].astype(np.int64), value))
                    else:
                        worst = max(worst, rel_err(got[key], value))
            held = session.device_bytes  # the buffers grown from batch 1 to 8 (decision 0037)
        finally:
            session.close()
        ok = worst < self.args.tolerance
        detail = f"max relative error {worst:.2e} (limit {self.args.tolerance:g})"
        detail += f", {held:,} bytes of device buffers after batches 1, 4, 8"
        if name == "decoder":
            detail += f", argmax tokens {'equal' if tokens_same else 'DIFFER (near-ties?)'}"
        return ("PASS" if ok else "FAIL"), detail, {"rel_err": worst, "tokens_equal": tokens_same}

    def threads(self) -> tuple[str, str, dict[str, Any]]:
        if "mlp" not in self.plans or self.ort is None:
            return "SKIP", "needs a built engine and onnxruntime", {}
        session = self._session("mlp")
        errors: list[str] = []
        worst = [0.0]

        def work(i: int) -> None:
            rng = np.random.default_rng(i)
            for _ in range(25):
                inputs = example_inputs("mlp", int(rng.integers(1, 9)), rng, False)
                try:
                    err = rel_err(session.run(inputs)["y"], self._reference("mlp", inputs)["y"])
                    worst[0] = max(worst[0], err)
                except Exception as exc:
                    errors.append(str(exc))

        try:
            workers = [
                threading.Thread(target=work, args=(i,), name=f"infer-worker-{i}") for i in range(4)
            ]
            for t in workers:
                t.start()
            for t in workers:
                t.join(120)
            contexts = session.contexts
        finally:
            session.close()
        ok = not errors and worst[0] < self.args.tolerance
        detail = (
            f"4 threads x 25 runs, {contexts} execution contexts, max relative error {worst[0]:.2e}"
        )
        if errors:
            detail += f"; {len(errors)} errors, first: {errors[0]}"
        return ("PASS" if ok else "FAIL"), detail, {"contexts": contexts}

    def swaps(self) -> tuple[str, str, dict[str, Any]]:
        from agent.models.backends import cuda

        if "mlp" not in self.plans or "conv" not in self.plans:
            return "SKIP", "needs the built engines", {}
        device = cuda.get_device(self.args.device)
        names = ["mlp", "conv"]
        inputs = {n: example_inputs(n, 2, self.rng, False) for n in names}
        for n in names:  # first loads pay CUDA/TensorRT one-time allocations: not a leak
            s = self._session(n)
            s.run(inputs[n])
            s.close()
        before_free, _ = device.mem_get_info()
        rss_before = rss_mib()
        started = time.monotonic()
        for cycle in range(self.args.swaps):
            name = names[cycle % 2]
            s = self._session(name)
            s.run(inputs[name])
            s.close()
        took = time.monotonic() - started
        after_free, _ = device.mem_get_info()
        grown = (before_free - after_free) / MIB
        ok = grown <= self.args.leak_mib
        detail = (
            f"{self.args.swaps} load/run/close cycles in {took:.1f} s: "
            f"device free {before_free / MIB:.0f} -> "
            f"{after_free / MIB:.0f} MiB (used {grown:+.1f} MiB, limit {self.args.leak_mib} MiB); "
            f"max RSS {rss_before:.0f} -> {rss_mib():.0f} MiB"
        )
        if device.identity.integrated:
            detail += " (integrated GPU: free memory is shared with the CPU, so this is noisy)"
        return ("PASS" if ok else "FAIL"), detail, {"device_used_mib": grown}

    def latency(self) -> tuple[str, str, dict[str, Any]]:
        if "mlp" not in self.plans:
            return "SKIP", "needs the built engine", {}
        results = {}
        for zero_copy in (False, True):
            session = self._session("mlp", zero_copy=zero_copy)
            try:
                x = example_inputs("mlp", 1, self.rng, False)
                for _ in range(20):
                    session.run(x)
                started = time.perf_counter()
                for _ in range(500):
                    session.run(x)
                results["zero_copy" if zero_copy else "copies"] = (
                    (time.perf_counter() - started) / 500 * 1e6
                )
            finally:
                session.close()
        detail = (
            ", ".join(f"{k} {v:.0f} us" for k, v in results.items()) + " per run (mlp, batch 1)"
        )
        return "PASS", detail, {"us_per_run": results}

    def fp16(self) -> tuple[str, str, dict[str, Any]]:
        from agent.models.backends.tensorrt import TensorRTBackend
        from agent.models.engine_builder import BuildOptions, build_engine

        if self.ort is None:
            return "SKIP", "needs onnxruntime", {}
        plan = build_engine(
            self.repo / "conv" / "1" / "model.onnx",
            self.repo / "conv",
            BuildOptions(cache_dir=self.cache, fp16=True, device=self.args.device),
        )
        session = TensorRTBackend().load(plan, BackendOptions())
        try:
            inputs = example_inputs("conv", 4, self.rng, False)
            err = rel_err(session.run(inputs)["scores"], self._reference("conv", inputs)["scores"])
        finally:
            session.close()
        return (
            ("PASS" if err < 1e-2 else "FAIL"),
            f"conv net FP16 relative error {err:.2e} (limit 1e-2)",
            {},
        )

    def ort_gpu(self) -> tuple[str, str, dict[str, Any]]:
        from agent.models.backends.onnxruntime import OnnxRuntimeBackend

        if self.ort is None:
            return "SKIP", "onnxruntime not importable", {}
        available = self.ort.get_available_providers()
        wanted = [
            p for p in ("TensorrtExecutionProvider", "CUDAExecutionProvider") if p in available
        ]
        if not wanted:
            return (
                "SKIP",
                f"no GPU execution provider in this onnxruntime ({', '.join(available)})",
                {},
            )
        onnx = demo_models.save(demo_models.mlp(), self.root / "ort" / "model.onnx")
        options = BackendOptions(
            providers=(*wanted, "CPUExecutionProvider"),
            extra={
                "gpu": {
                    "engine_cache_path": str(self.root / "ort-trt-cache"),
                    "device_id": self.args.device,
                }
            },
        )
        session = OnnxRuntimeBackend().load(onnx, options)
        inputs = example_inputs("mlp", 4, self.rng, False)
        err = rel_err(session.run(inputs)["y"], self._reference("mlp", inputs)["y"])
        session.close()
        running = ", ".join(session.providers)
        ok = err < self.args.tolerance and running.split(",")[0] in wanted
        return ("PASS" if ok else "FAIL"), f"runs on {running}, relative error {err:.2e}", {}

    def _cuda_options(self) -> tuple[BackendOptions | None, str]:
        """ONNX Runtime's options for the CUDA provider on the chosen device, or None and why
        the checks that need it are skipped."""
        if self.ort is None:
            return None, "onnxruntime not importable"
        available = self.ort.get_available_providers()
        if "CUDAExecutionProvider" not in available:
            return None, f"no CUDA execution provider ({', '.join(available)})"
        options = BackendOptions(
            providers=("CUDAExecutionProvider", "CPUExecutionProvider"),
            extra={"gpu": {"device_id": self.args.device}},
        )
        return options, ""

    def ort_generate(self) -> tuple[str, str, dict[str, Any]]:
        """The generate fixture on the first GPU provider: the cache kept on the device
        (IOBinding), greedy tokens equal to Hugging Face's, ms a token."""
        from agent.models.backends.onnxruntime import OnnxRuntimeBackend

        options, skipped = self._cuda_options()
        if options is None:
            return "SKIP", skipped, {}
        folder = Path(__file__).resolve().parent.parent / "tests/fixtures/real/decoders/gpt2"
        reference = json.loads((folder.parent / "reference.json").read_text())
        case = reference["models"]["gpt2"][0]
        session = OnnxRuntimeBackend().load(folder / "model.onnx", options)
        try:
            setup, tokens, ms = _greedy_tokens(session, folder, case["prompt"])
        finally:
            session.close()
        bound = len(setup.device_cache)
        ok = tokens == case["greedy"] and bound > 0
        detail = f"{bound} cache outputs kept on the device, {ms:.2f} ms a token"
        return ("PASS" if ok else "FAIL"), detail + ("" if ok else f", tokens {tokens}"), {}

    def ort_prompt_lookup(self) -> tuple[str, str, dict[str, Any]]:
        """The generate fixture on the first GPU provider with `prompt_lookup` 8: the cache
        cut on the device (`ort_cut`) after each run of guesses, greedy tokens equal to
        Hugging Face's."""
        from agent.models.backends.onnxruntime import OnnxRuntimeBackend

        options, skipped = self._cuda_options()
        if options is None:
            return "SKIP", skipped, {}
        folder = Path(__file__).resolve().parent.parent / "tests/fixtures/real/decoders/gpt2"
        reference = json.loads((folder.parent / "reference.json").read_text())
        details, ok = [], True
        session = OnnxRuntimeBackend().load(folder / "model.onnx", options)
        try:
            for case in reference["models"]["gpt2"]:
                setup, tokens, ms = _greedy_tokens(
                    session, folder, case["prompt"], params={"prompt_lookup": 8}
                )
                equal = tokens == case["greedy"]
                ok = ok and equal and setup.device_cut is not None
                details.append(f"{'equal' if equal else tokens}, {ms:.2f} ms a token")
        finally:
            session.close()
        return ("PASS" if ok else "FAIL"), "; ".join(details), {}

    def ort_prefix_cache(self) -> tuple[str, str, dict[str, Any]]:
        """The Llama-like fixture on the first GPU provider with a prefix cache: a prompt
        asked again runs only its last token from the kept device values, and a next turn's
        beginning is cut on the device; both give the uncached tokens."""
        from agent.models.backends.onnxruntime import OnnxRuntimeBackend
        from agent.models.decoder_layout import open_generation
        from agent.models.generate_config import GenerateConfig

        options, skipped = self._cuda_options()
        if options is None:
            return "SKIP", skipped, {}
        folder = Path(__file__).resolve().parent.parent / "tests/fixtures/real/decoders/llama"
        case = json.loads((folder.parent / "reference.json").read_text())["models"]["llama"][0]
        session = OnnxRuntimeBackend().load(folder / "model.onnx", options)
        try:
            setup = open_generation(GenerateConfig(prefix_cache_mb=16), session, folder)
            first = _generation(session, setup, case["ids"], 24)
            again = _generation(session, setup, case["ids"], 24)
            turn = case["ids"] + case["greedy"][:5] + case["ids"][:3]
            goes_on = _generation(session, setup, turn, 12)
            fresh = open_generation(None, session, folder)
            want = _generation(session, fresh, turn, 12)
        finally:
            session.close()
        ok = first.tokens == again.tokens == case["greedy"] and goes_on.tokens == want.tokens
        ok = ok and again.cached_tokens == len(case["ids"]) - 1 and goes_on.cached_tokens > 0
        detail = f"cached {again.cached_tokens} and {goes_on.cached_tokens} prompt tokens"
        return ("PASS" if ok else "FAIL"), detail, {}

    def ort_genai(self) -> tuple[str, str, dict[str, Any]]:
        """ONNX Runtime GenAI's fp32 and int4 builds (`GroupQueryAttention`, `MatMulNBits`) on
        the first GPU provider, cache on the device: fp32's greedy tokens equal GenAI's on the
        CPU (and Hugging Face's); int4's are reported (the GPU's int4 kernel is not the CPU's
        accuracy level 4, so its tokens may differ)."""
        from agent.models.backends.onnxruntime import OnnxRuntimeBackend

        options, skipped = self._cuda_options()
        if options is None:
            return "SKIP", skipped, {}
        fixtures = Path(__file__).resolve().parent.parent / "tests/fixtures/real/genai"
        case = json.loads((fixtures / "reference.json").read_text())["cases"][0]
        details, ok = [], True
        for build, file in (("fp32", "model.onnx"), ("int4", GENAI_INT4_FILE)):
            session = OnnxRuntimeBackend().load(fixtures / build / file, options)
            try:
                setup, tokens, ms = _greedy_tokens(
                    session, fixtures / build, case["prompt"], new_tokens=len(case[build])
                )
            finally:
                session.close()
            bound = len(setup.device_cache)
            equal = tokens == case[build]
            ok = ok and bound > 0 and (equal or build == "int4")
            said = "equal to the CPU's" if equal else f"{tokens}"
            details.append(f"{build} tokens {said}, {bound} kept, {ms:.2f} ms a token")
        return ("PASS" if ok else "FAIL"), "; ".join(details), {}

    def ort_seq2seq(self) -> tuple[str, str, dict[str, Any]]:
        """The encoder-decoder fixtures (T5, BART) on the first GPU provider: the encoder
        opened beside the decoder, both caches kept on the device, greedy tokens equal to
        Hugging Face's, ms a token."""

        options, skipped = self._cuda_options()
        if options is None:
            return "SKIP", skipped, {}
        fixtures = Path(__file__).resolve().parent.parent / "tests/fixtures/real/seq2seq"
        reference = json.loads((fixtures / "reference.json").read_text())
        details, ok = [], True
        for arch in ("t5", "bart"):
            case = reference["models"][arch]["cases"][0]
            tokens, bound, ms = _encoder_decoder_tokens(
                fixtures / arch, options, len(case["greedy"]), prompt=case["prompt"]
            )
            equal = tokens == case["greedy"]
            ok = ok and equal and bound > 0
            said = "equal" if equal else f"{tokens}"
            details.append(f"{arch} tokens {said}, {bound} cache outputs kept, {ms:.2f} ms a token")
        return ("PASS" if ok else "FAIL"), "; ".join(details), {}

    def ort_whisper(self) -> tuple[str, str, dict[str, Any]]:
        """The Whisper fixture on the first GPU provider: features computed on the host, the
        encoder and the decoder on the device, greedy tokens equal to Hugging Face's for a
        language asked and for one detected, ms a token."""

        options, skipped = self._cuda_options()
        if options is None:
            return "SKIP", skipped, {}
        fixtures = Path(__file__).resolve().parent.parent / "tests/fixtures/real/whisper"
        reference = json.loads((fixtures / "reference.json").read_text())
        audio = dict(np.load(fixtures / "reference.npz"))
        details, ok = [], True
        for case in reference["cases"][:2]:  # a language asked; one detected
            asked = {k: case[k] for k in ("language", "task") if case[k] is not None}
            samples = {"input_values": audio[f"audio_{case['clip']}"]}
            tokens, bound, ms = _encoder_decoder_tokens(
                fixtures, options, len(case["tokens"]), inputs=samples, params=asked
            )
            equal = tokens == case["tokens"]
            ok = ok and equal and bound > 0
            said = "equal" if equal else f"{tokens}"
            details.append(
                f"{case['clip']} {asked or 'detected'}: tokens {said}, {bound} cache outputs "
                f"kept, {ms:.2f} ms a token (the encoder's run included)"
            )
        return ("PASS" if ok else "FAIL"), "; ".join(details), {}

    def ort_image_to_text(self) -> tuple[str, str, dict[str, Any]]:
        """The TrOCR-like fixture on the first GPU provider: each PNG preprocessed on the host,
        the encoder and the decoder on the device, greedy tokens equal to Hugging Face's."""
        from agent.protocol.errors import Limits
        from agent.protocol.images import encoded_image

        options, skipped = self._cuda_options()
        if options is None:
            return "SKIP", skipped, {}
        fixtures = Path(__file__).resolve().parent.parent / "tests/fixtures/real/trocr"
        reference = json.loads((fixtures / "reference.json").read_text())
        equal, bound, ms = 0, 0, 0.0
        cases = reference["cases"]
        for case in cases:
            image = encoded_image((fixtures / case["image"]).read_bytes(), Limits(), "x", None)
            tokens, bound, ms = _encoder_decoder_tokens(
                fixtures, options, len(case["greedy"]), inputs={"pixel_values": image}
            )
            equal += tokens == case["greedy"]
        ok = equal == len(cases) and bound > 0
        detail = f"{equal}/{len(cases)} images' tokens equal, {bound} cache outputs kept, "
        return ("PASS" if ok else "FAIL"), detail + f"{ms:.2f} ms a token", {}

    def trt_generate(self, **tensorrt: Any) -> tuple[str, str, dict[str, Any]]:
        """The generate fixture built into an engine by the agent's builder and run by its
        own TensorRT session: the cache kept in the session's device arrays, greedy tokens
        equal to Hugging Face's, ms a token."""
        from agent.models.backends.tensorrt import TensorRTBackend
        from agent.models.engine_builder import BuildOptions, build_engine

        fixture = Path(__file__).resolve().parent.parent / "tests/fixtures/real/decoders/gpt2"
        reference = json.loads((fixture.parent / "reference.json").read_text())
        case = reference["models"]["gpt2"][0]
        folder = self.repo / "writer" / "1"
        shutil.copytree(fixture, folder, dirs_exist_ok=True)
        plan = build_engine(
            folder / "model.onnx",
            folder.parent,
            BuildOptions(cache_dir=self.cache, device=self.args.device),
        )
        session = TensorRTBackend().load(plan, BackendOptions(extra={"tensorrt": tensorrt}))
        try:
            setup, tokens, ms = _greedy_tokens(session, folder, case["prompt"])
            kept = session.device_bytes
        finally:
            session.close()
        bound = len(setup.device_cache)
        ok = tokens == case["greedy"] and bound > 0
        detail = (
            f"{bound} cache outputs kept on the device ({kept // 1024} KiB), {ms:.2f} ms a token"
        )
        return ("PASS" if ok else "FAIL"), detail + ("" if ok else f", tokens {tokens}"), {}

    def run_all(self) -> None:
        r = self.report
        r.run("build engines", self.build)
        r.run("engine cache hit", self.cache_hit)
        try:
            import pycuda.driver  # noqa: F401
        except ImportError as exc:
            r.add("backend", "SKIP", f"pycuda not importable, the backend checks need it ({exc})")
            return
        for name in MODELS:
            r.run(f"compare {name} (FP32)", lambda n=name: self.compare(n))
        r.run("compare mlp (zero-copy)", lambda: self.compare("mlp", zero_copy=True))
        for name in MODELS:  # decision 0038: the agent gives each run its activation memory
            r.run(
                f"compare {name} (activation memory by run)",
                lambda n=name: self.compare(n, activation_memory="by_run"),
            )
        r.run("concurrent threads", self.threads)
        r.run(f"{self.args.swaps} engine swaps", self.swaps)
        r.run("latency", self.latency)
        r.run("FP16 engine", self.fp16)
        r.run("ONNX Runtime GPU providers", self.ort_gpu)
        r.run("ONNX Runtime generate, cache on the device", self.ort_generate)
        r.run("ONNX Runtime prompt lookup, cache cut on the device", self.ort_prompt_lookup)
        r.run("ONNX Runtime prefix cache, kept on the device", self.ort_prefix_cache)
        r.run("ONNX Runtime GenAI builds, cache on the device", self.ort_genai)
        r.run("ONNX Runtime encoder-decoder generate, caches on the device", self.ort_seq2seq)
        r.run("ONNX Runtime Whisper transcription, caches on the device", self.ort_whisper)
        r.run("ONNX Runtime image to text, caches on the device", self.ort_image_to_text)
        r.run("TensorRT generate, cache in the session's device arrays", self.trt_generate)
        r.run(
            "TensorRT generate, activation memory by run",
            lambda: self.trt_generate(activation_memory="by_run"),
        )


def _encoder_decoder_tokens(
    folder: Path,
    options: BackendOptions,
    new_tokens: int,
    prompt: str = "",
    inputs: dict[str, Any] | None = None,
    params: dict[str, Any] | None = None,
) -> tuple[list[int], int, float]:
    """The encoder-decoder fixture in `folder` on ONNX Runtime with `options` (its encoder
    opened beside the decoder), `new_tokens` greedy tokens of `prompt` or of `inputs`; (the
    tokens, the cache outputs kept on the device, ms a token)."""
    from agent.models.backends.onnxruntime import OnnxRuntimeBackend

    backend = OnnxRuntimeBackend()
    session = backend.load(folder / "model.onnx", options)
    try:
        setup, tokens, ms = _greedy_tokens(
            session,
            folder,
            prompt,
            new_tokens=new_tokens,
            open_encoder=lambda f: backend.load(f, options),
            inputs=inputs,
            params=params,
        )
        setup.close()
    finally:
        session.close()
    return tokens, len(setup.device_cache), ms


def _generation(session: Any, setup: Any, ids: list[int], new_tokens: int) -> Any:
    """One greedy generation of `ids` on `session` with `setup`, to its end: its ask."""
    from agent.inference import generate
    from agent.inference.modes import Member, Run
    from agent.models.model_config import StreamConfig

    ask = generate.ask_of({"input_ids": np.array(ids)}, {"max_new_tokens": new_tokens}, setup)
    run = Run(session, StreamConfig(mode="generate"), [Member({}, 1, generation=ask)])
    for _ in generate.generate(run):
        pass
    return ask


def _greedy_tokens(
    session: Any,
    folder: Path,
    prompt: str,
    new_tokens: int = 24,
    open_encoder: Callable[[Path], Any] | None = None,
    inputs: dict[str, Any] | None = None,
    params: dict[str, Any] | None = None,
) -> tuple[Any, list[int], float]:
    """The generate loop on `session` for the fixture in `folder` (an encoder-decoder's
    encoder opened by `open_encoder`): `new_tokens` greedy tokens of `prompt` (or of
    `inputs`, a recording's, with `params`); (the generation setup, the tokens, ms a
    token)."""
    from agent.inference import generate
    from agent.inference.modes import Member, Run
    from agent.models.decoder_layout import open_generation
    from agent.models.model_config import StreamConfig

    setup = open_generation(None, session, folder, open_encoder)
    asked = {"max_new_tokens": new_tokens, **(params or {})}
    given = inputs if inputs is not None else {"prompt": np.array(prompt, dtype=object)}
    ask = generate.ask_of(given, asked, setup)
    run = Run(session, StreamConfig(mode="generate"), [Member({}, 1, generation=ask)])
    started = time.perf_counter()
    tokens = [int(t) for ps in generate.generate(run) for p in ps for t in p.outputs["tokens"]]
    return setup, tokens, (time.perf_counter() - started) * 1000 / max(len(tokens), 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--swaps", type=int, default=50)
    parser.add_argument("--tolerance", type=float, default=1e-3, help="FP32 relative error limit")
    parser.add_argument(
        "--leak-mib", type=float, default=16.0, help="device memory growth allowed over the swaps"
    )
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument(
        "--workdir", help="keep models and engines here (default: a temporary folder)"
    )
    args = parser.parse_args(argv)
    report = Report()
    check = GpuCheck(args, report)
    try:
        if check.environment():
            check.run_all()
    finally:
        try:
            from agent.models.backends.tensorrt import shutdown

            shutdown()
        except Exception as exc:
            report.add("shutdown", "FAIL", f"releasing the runtime and device failed: {exc}")
    report.summary()
    report.write(args.json)
    return 1 if report.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
