#!/usr/bin/env python3
"""Dev-only: regenerate ``tests/fixtures/real/`` from real model exporters.

Not run by CI. It needs the heavy export stack pinned in ``scripts/export-requirements.txt``
(torch CPU, transformers, optimum-onnx, scikit-learn, skl2onnx, silero-vad), installed into a
scratch virtualenv that is never committed::

    python3 -m venv .venv-export
    .venv-export/bin/pip install torch==2.13.0
    .venv-export/bin/pip install -c <(echo torch==2.13.0) -r scripts/export-requirements.txt
    .venv-export/bin/python scripts/make_real_models.py [--out tests/fixtures/real] [--only NAME]

Every fixture is a folder ``<out>/<name>/`` with

- ``model.onnx``: the file exactly as the exporter wrote it (or as a PyPI package ships it);
- ``reference.npz``: ``in.<input name>`` / ``out.<output name>`` arrays (strings as numpy
  unicode arrays; loads with ``allow_pickle=False``);
- ``reference.json``: metadata, and the outputs that are not tensors (ZipMap's lists of maps,
  whose keys are written as JSON strings; ``json_output_key_types`` gives the real key type).

References come from the exporting framework (torch, scikit-learn), not from onnxruntime; each
model is then run with onnxruntime and compared against them, and the script fails loudly when
a difference is over the fixture's tolerance. Everything is seeded and the files are written
byte-for-byte reproducibly (fixed zip timestamps), so a rerun with the same pins changes nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import io
import json
import os
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures" / "real"
MAX_FIXTURE_BYTES = 2 * 1024 * 1024

# Nothing here may reach a model hub: every model is built locally or shipped in a package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


@dataclass
class Fixture:
    """One exported model with its framework-computed reference."""

    name: str
    model: bytes
    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]
    family: str
    exporter: dict[str, str]
    framework: dict[str, str]
    tolerance: dict[str, float]
    notes: str
    json_outputs: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    json_output_key_types: dict[str, str] = field(default_factory=dict)


def version(dist: str) -> str:
    return importlib.metadata.version(dist)


def cpu_session(model: bytes, *, optimize: bool = True) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 4
    if not optimize:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model, sess_options=opts, providers=["CPUExecutionProvider"])


# --------------------------------------------------------------------------------------------
# 1. gpt2: tiny random GPT-2, exported with optimum (text-generation-with-past)
# --------------------------------------------------------------------------------------------


def _cache_layers(cache: Any) -> list[tuple[Any, Any]]:
    """(key, value) per layer from whatever cache object this transformers version returns."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    if hasattr(cache, "to_legacy_cache"):
        return [(k, v) for k, v in cache.to_legacy_cache()]
    return [(k, v) for k, v in cache]


def make_gpt2() -> Fixture:
    import torch
    from optimum.exporters.onnx import main_export
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=256, n_positions=64)
    model = GPT2LMHeadModel(config).eval()
    head_dim = config.n_embd // config.n_head

    with tempfile.TemporaryDirectory(prefix="gpt2-export-") as tmp:
        src = Path(tmp) / "hf"
        dst = Path(tmp) / "onnx"
        model.save_pretrained(src)
        # Same code path as `optimum-cli export onnx --model SRC --task
        # text-generation-with-past DST` (the CLI only parses its arguments into this call).
        main_export(str(src), output=str(dst), task="text-generation-with-past", device="cpu")
        produced = sorted(p.name for p in dst.glob("*.onnx*"))
        if produced != ["model.onnx"]:
            raise SystemExit(f"gpt2: expected optimum to write only model.onnx, got {produced}")
        model_bytes = (dst / "model.onnx").read_bytes()

    prompt = [1, 2, 3, 4, 5]
    seq = len(prompt)
    inputs: dict[str, np.ndarray] = {}
    for arg in cpu_session(model_bytes).get_inputs():
        if arg.name == "input_ids":
            inputs[arg.name] = np.array([prompt], dtype=np.int64)
        elif arg.name == "attention_mask":
            inputs[arg.name] = np.ones((1, seq), dtype=np.int64)
        elif arg.name == "position_ids":
            inputs[arg.name] = np.arange(seq, dtype=np.int64)[None, :]
        elif arg.name.startswith("past_key_values."):
            inputs[arg.name] = np.zeros((1, config.n_head, 0, head_dim), dtype=np.float32)
        else:
            raise SystemExit(f"gpt2: unexpected ONNX input {arg.name!r}")

    with torch.no_grad():
        result = model(
            input_ids=torch.from_numpy(inputs["input_ids"]),
            attention_mask=torch.from_numpy(inputs["attention_mask"]),
            position_ids=torch.from_numpy(inputs["position_ids"]),
            use_cache=True,
        )
    outputs = {"logits": result.logits.numpy().astype(np.float32)}
    for i, (key, value) in enumerate(_cache_layers(result.past_key_values)):
        outputs[f"present.{i}.key"] = key.numpy().astype(np.float32)
        outputs[f"present.{i}.value"] = value.numpy().astype(np.float32)

    return Fixture(
        name="gpt2",
        model=model_bytes,
        inputs=inputs,
        outputs=outputs,
        family="transformers-decoder",
        exporter={
            "name": "optimum-onnx",
            "version": version("optimum-onnx"),
            "optimum": version("optimum"),
            "call": "optimum.exporters.onnx.main_export(task='text-generation-with-past')",
        },
        framework={
            "name": "torch",
            "version": version("torch"),
            "transformers": version("transformers"),
        },
        tolerance={"rtol": 1e-4, "atol": 1e-4},
        notes=(
            "Randomly initialised GPT-2 (GPT2Config(n_layer=2, n_head=2, n_embd=32, "
            "vocab_size=256, n_positions=64), torch.manual_seed(0)), save_pretrained, then "
            "optimum's text-generation-with-past export (the single decoder-with-past file "
            "model.onnx). Reference: HF torch forward on prompt [1,2,3,4,5] with "
            "attention_mask of ones, position_ids 0..4 and an empty past (past_key_values.* "
            "of shape [1, 2, 0, 16]); out.present.* are the torch cache tensors."
        ),
    )


# --------------------------------------------------------------------------------------------
# 2. silero_vad: the ONNX file shipped in the silero-vad wheel, reference from its JIT model
# --------------------------------------------------------------------------------------------

SILERO_FILE = "silero_vad_16k_op15.onnx"


def make_silero_vad() -> Fixture:
    from importlib import resources

    import silero_vad
    import torch

    torch.set_num_threads(1)
    model_bytes = (resources.files("silero_vad.data") / SILERO_FILE).read_bytes()

    rng = np.random.default_rng(0)
    chunk = (rng.standard_normal(512) * 0.1).astype(np.float32)
    context = np.zeros((1, 64), dtype=np.float32)  # the wrappers' 64-sample context, empty

    jit = silero_vad.load_silero_vad(onnx=False)
    jit.reset_states()
    with torch.no_grad():
        prob = jit(torch.from_numpy(chunk)[None, :], 16000)
    state = jit._state.detach()

    inputs = {
        "input": np.concatenate([context, chunk[None, :]], axis=1),
        "state": np.zeros((2, 1, 128), dtype=np.float32),
        "sr": np.array(16000, dtype=np.int64),
    }
    outputs = {
        "output": prob.detach().numpy().astype(np.float32),
        "stateN": state.numpy().astype(np.float32),
    }
    return Fixture(
        name="silero_vad",
        model=model_bytes,
        inputs=inputs,
        outputs=outputs,
        family="silero-vad",
        exporter={
            "name": f"silero-vad package file silero_vad/data/{SILERO_FILE}",
            "version": version("silero-vad"),
        },
        framework={"name": "torch (silero-vad JIT model)", "version": version("torch")},
        tolerance={"rtol": 1e-4, "atol": 1e-5},
        notes=(
            f"{SILERO_FILE} copied unchanged from the silero-vad wheel (the file "
            "load_silero_vad(onnx=True, opset_version=15) uses; 16 kHz only). in.input is "
            "64 zero samples of context followed by one 512-sample chunk of seeded gaussian "
            "audio (std 0.1) -- exactly what the package's OnnxWrapper feeds on a first "
            "call -- with zero state and sr=16000 (int64 scalar). Outputs come from the "
            "package's torch JIT model (load_silero_vad(onnx=False)) on the same 512-sample "
            "chunk after reset_states(); out.stateN is its _state afterwards."
        ),
    )


# --------------------------------------------------------------------------------------------
# 3. ocr_det: DBNet-style text detector in torch, exported with torch.onnx.export
# --------------------------------------------------------------------------------------------


def _build_ocr_det() -> Any:
    import torch
    from torch import nn
    from torch.nn import functional as F

    def cbr(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
        return nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()
        )

    def down2(cin: int, cout: int) -> nn.Sequential:
        # Patch-merging downsample (kernel 2, stride 2, no padding).
        return nn.Sequential(
            nn.Conv2d(cin, cout, 2, 2, bias=False), nn.BatchNorm2d(cout), nn.ReLU()
        )

    class DBNetLite(nn.Module):
        """Backbone to 1/32, FPN (upsample and add) neck, DB probability head."""

        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(cbr(3, 8, 2), nn.MaxPool2d(3, 2, 1))  # 1/4
            self.c2 = nn.Sequential(cbr(8, 16), cbr(16, 16))  # 1/4
            self.c3 = nn.Sequential(cbr(16, 24, 2), cbr(24, 24))  # 1/8
            self.c4 = nn.Sequential(down2(24, 32), cbr(32, 32))  # 1/16
            self.c5 = nn.Sequential(cbr(32, 48, 2), cbr(48, 48))  # 1/32
            inner = 16
            self.lateral = nn.ModuleList(
                [nn.Conv2d(c, inner, 1, bias=False) for c in (16, 24, 32, 48)]
            )
            self.smooth = nn.ModuleList(
                [nn.Conv2d(inner, inner // 4, 3, 1, 1, bias=False) for _ in range(4)]
            )
            self.head = nn.Sequential(
                nn.Conv2d(inner, inner // 4, 3, 1, 1, bias=False),
                nn.BatchNorm2d(inner // 4),
                nn.ReLU(),
                nn.ConvTranspose2d(inner // 4, inner // 4, 2, 2),
                nn.BatchNorm2d(inner // 4),
                nn.ReLU(),
                nn.ConvTranspose2d(inner // 4, 1, 2, 2),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            c2 = self.c2(self.stem(x))
            c3 = self.c3(c2)
            c4 = self.c4(c3)
            c5 = self.c5(c4)
            in2, in3, in4, in5 = (
                lat(c) for lat, c in zip(self.lateral, (c2, c3, c4, c5), strict=True)
            )

            def up(t: torch.Tensor, factor: int) -> torch.Tensor:
                return F.interpolate(t, scale_factor=factor, mode="nearest")

            out4 = in4 + up(in5, 2)
            out3 = in3 + up(out4, 2)
            out2 = in2 + up(out3, 2)
            p5 = up(self.smooth[3](in5), 8)
            p4 = up(self.smooth[2](out4), 4)
            p3 = up(self.smooth[1](out3), 2)
            p2 = self.smooth[0](out2)
            return torch.sigmoid(self.head(torch.cat([p5, p4, p3, p2], dim=1)))

    torch.manual_seed(0)
    model = DBNetLite()
    with torch.no_grad():  # non-trivial BatchNorm statistics, still seeded
        for mod in model.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.normal_(0.0, 0.1)
                mod.running_mean.normal_(0.0, 0.1)
                mod.running_var.uniform_(0.5, 1.5)
    return model.eval()


def make_ocr_det() -> Fixture:
    import torch

    torch.set_num_threads(1)
    model = _build_ocr_det()
    rng = np.random.default_rng(0)
    x = rng.random((1, 3, 64, 96), dtype=np.float32)

    with tempfile.TemporaryDirectory(prefix="ocr-det-export-") as tmp:
        path = Path(tmp) / "model.onnx"
        torch.onnx.export(
            model,
            (torch.from_numpy(x),),
            str(path),
            input_names=["x"],
            output_names=["maps"],
            dynamic_axes={
                "x": {0: "batch", 2: "height", 3: "width"},
                "maps": {0: "batch", 2: "height", 3: "width"},
            },
            opset_version=17,
            dynamo=False,
        )
        model_bytes = path.read_bytes()

    with torch.no_grad():
        maps = model(torch.from_numpy(x)).numpy().astype(np.float32)

    # A real detector only takes sizes that are multiples of 32; check the export kept that.
    for optimize in (True, False):
        sess = cpu_session(model_bytes, optimize=optimize)
        for hw in ((1, 1), (33, 33), (64, 80)):
            try:
                sess.run(None, {"x": np.zeros((1, 3, *hw), dtype=np.float32)})
            except Exception as exc:  # onnxruntime raises its own Fail/InvalidArgument types
                print(
                    f"  ocr_det {hw} (optimize={optimize}) fails as expected: {type(exc).__name__}"
                )
            else:
                raise SystemExit(f"ocr_det: a {hw} image ran; it should fail")

    return Fixture(
        name="ocr_det",
        model=model_bytes,
        inputs={"x": x},
        outputs={"maps": maps},
        family="ocr-det-dbnet",
        exporter={
            "name": "torch.onnx.export (TorchScript exporter, dynamo=False, opset 17)",
            "version": version("torch"),
        },
        framework={"name": "torch", "version": version("torch")},
        tolerance={"rtol": 1e-4, "atol": 1e-5},
        notes=(
            "DBNet-style detector (PP-OCR det family) with seeded random weights: conv+BN+ReLU "
            "backbone down to 1/32 (stride-2 convs, a max-pool, a 2x2/stride-2 unpadded "
            "conv), FPN neck (1x1 laterals, nearest upsample x2 and add, then concat of the "
            "four levels at 1/4), DB head (conv, two 2x2 transposed convs) and a sigmoid: "
            "maps is [N,1,H,W] at input resolution. Only H and W that are multiples of 32 "
            "run: 1x1 fails in the unpadded 2x2 conv, e.g. 33x33 or 64x80 in the FPN Add. "
            "Reference: torch output on seeded uniform [0,1) input 1x3x64x96."
        ),
    )


# --------------------------------------------------------------------------------------------
# 4-6. scikit-learn models converted with skl2onnx defaults
# --------------------------------------------------------------------------------------------


# skl2onnx names the graph with a random uuid4 unless told; a fixed name keeps reruns
# byte-identical (the name is not used by onnxruntime).
GRAPH_NAME = "skl2onnx"


def _sklearn_meta() -> tuple[dict[str, str], dict[str, str]]:
    return (
        {"name": "skl2onnx", "version": version("skl2onnx")},
        {"name": "scikit-learn", "version": version("scikit-learn")},
    )


def _proba_maps(classes: Any, proba: np.ndarray) -> list[dict[str, float]]:
    return [{str(c): float(p) for c, p in zip(classes, row, strict=True)} for row in proba]


def make_sklearn_iris() -> Fixture:
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import FloatTensorType
    from sklearn.datasets import load_iris
    from sklearn.linear_model import LogisticRegression

    x_all, y_all = load_iris(return_X_y=True)
    clf = LogisticRegression(max_iter=500).fit(x_all, y_all)
    onx = convert_sklearn(
        clf, initial_types=[("float_input", FloatTensorType([None, 4]))], name=GRAPH_NAME
    )

    x = x_all[:5].astype(np.float32)
    exporter, framework = _sklearn_meta()
    return Fixture(
        name="sklearn_iris",
        model=onx.SerializeToString(),
        inputs={"float_input": x},
        outputs={"output_label": np.asarray(clf.predict(x), dtype=np.int64)},
        json_outputs={"output_probability": _proba_maps(clf.classes_, clf.predict_proba(x))},
        json_output_key_types={"output_probability": "int64"},
        family="sklearn-classifier",
        exporter=exporter,
        framework=framework,
        tolerance={"rtol": 1e-4, "atol": 1e-5},
        notes=(
            "LogisticRegression(max_iter=500) fit on sklearn's bundled iris (int labels 0..2), "
            "convert_sklearn with initial_types [('float_input', FloatTensorType([None, 4]))] "
            "and no options (ZipMap on). Reference: sklearn predict / predict_proba on the "
            "first 5 rows, cast to float32 before predicting (the same values the model gets)."
        ),
    )


STRING_ROWS = [0, 50, 100, 70, 83]


def make_sklearn_strings() -> Fixture:
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import FloatTensorType
    from sklearn.datasets import load_iris
    from sklearn.tree import DecisionTreeClassifier

    iris = load_iris()
    labels = np.asarray(iris.target_names)[iris.target]  # "setosa" / "versicolor" / "virginica"
    clf = DecisionTreeClassifier(max_depth=3, random_state=0).fit(iris.data, labels)
    onx = convert_sklearn(
        clf, initial_types=[("float_input", FloatTensorType([None, 4]))], name=GRAPH_NAME
    )

    x = iris.data[STRING_ROWS].astype(np.float32)
    predicted = clf.predict(x)
    exporter, framework = _sklearn_meta()
    return Fixture(
        name="sklearn_strings",
        model=onx.SerializeToString(),
        inputs={"float_input": x},
        outputs={"output_label": np.asarray([str(s) for s in predicted])},
        json_outputs={"output_probability": _proba_maps(clf.classes_, clf.predict_proba(x))},
        json_output_key_types={"output_probability": "string"},
        family="sklearn-classifier",
        exporter=exporter,
        framework=framework,
        tolerance={"rtol": 1e-4, "atol": 1e-5},
        notes=(
            "DecisionTreeClassifier(max_depth=3, random_state=0) fit on iris with STRING "
            "labels (iris.target_names), convert_sklearn defaults (ZipMap on), so "
            "output_label is tensor(string) and output_probability seq(map(string,tensor("
            f"float))). Reference: sklearn predict / predict_proba on iris rows {STRING_ROWS} "
            "(one of each class plus two versicolor rows in impure leaves), as float32."
        ),
    )


TEXT_TRAIN: list[tuple[str, int]] = [
    ("the sun is shining today", 0),
    ("heavy rain and strong wind tonight", 0),
    ("snow falls on the cold hills", 0),
    ("a sunny and warm afternoon", 0),
    ("grey clouds and light drizzle", 0),
    ("the forecast says thunder and storms", 0),
    ("freezing fog in the early morning", 0),
    ("pasta with fresh tomato sauce", 1),
    ("warm bread and salted butter", 1),
    ("we ate spicy noodles for dinner", 1),
    ("a bowl of hot vegetable soup", 1),
    ("grilled fish with lemon and rice", 1),
    ("chocolate cake for dessert", 1),
    ("the team scored a late goal", 2),
    ("a tennis match in the evening", 2),
    ("the runner won the long race", 2),
    ("basketball players train hard", 2),
    ("the coach picked a new striker", 2),
    ("cycling up the mountain stage", 2),
    ("the swimmer broke the world record", 2),
]
TEXT_QUERIES = ["Rain and snow today", "spicy tomato soup", "the team won the match"]


def make_sklearn_text() -> Fixture:
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import StringTensorType
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import Pipeline

    texts = [t for t, _ in TEXT_TRAIN]
    labels = np.array([c for _, c in TEXT_TRAIN], dtype=np.int64)
    pipe = Pipeline([("tfidf", TfidfVectorizer()), ("clf", LogisticRegression(max_iter=500))])
    pipe.fit(texts, labels)
    onx = convert_sklearn(
        pipe,
        initial_types=[("input", StringTensorType([None, 1]))],
        name=GRAPH_NAME,
        # The one non-default: without it the StringNormalizer node asks onnxruntime for the
        # en_US.UTF-8 locale and session creation fails on hosts that lack it.
        options={TfidfVectorizer: {"locale": "C.UTF-8"}},
    )

    queries = np.asarray(TEXT_QUERIES)[:, None]
    exporter, framework = _sklearn_meta()
    return Fixture(
        name="sklearn_text",
        model=onx.SerializeToString(),
        inputs={"input": queries},
        outputs={"output_label": np.asarray(pipe.predict(TEXT_QUERIES), dtype=np.int64)},
        json_outputs={
            "output_probability": _proba_maps(pipe.classes_, pipe.predict_proba(TEXT_QUERIES))
        },
        json_output_key_types={"output_probability": "int64"},
        family="sklearn-text-pipeline",
        exporter=exporter,
        framework=framework,
        tolerance={"rtol": 1e-4, "atol": 1e-5},
        notes=(
            "Pipeline(TfidfVectorizer(), LogisticRegression(max_iter=500)) fit on 20 "
            "hand-written sentences (0 weather, 1 food, 2 sport), convert_sklearn with "
            "initial_types [('input', StringTensorType([None, 1]))] and ZipMap on. One "
            "non-default option: TfidfVectorizer locale='C.UTF-8'; with skl2onnx defaults "
            "the StringNormalizer node uses onnxruntime's default locale en_US.UTF-8 and "
            "InferenceSession() fails where that locale is not installed. Reference: sklearn "
            "predict / predict_proba on 3 sentences (in.input is a [3,1] unicode array)."
        ),
    )


# --------------------------------------------------------------------------------------------
# verification and writing
# --------------------------------------------------------------------------------------------


def _compare(name: str, got: np.ndarray, want: np.ndarray, tol: dict[str, float]) -> float:
    if got.shape != want.shape:
        raise SystemExit(f"{name}: shape {got.shape} from onnxruntime, {want.shape} expected")
    if want.dtype.kind in "USO":
        if [str(v) for v in got.ravel()] != [str(v) for v in want.ravel()]:
            raise SystemExit(f"{name}: {got!r} from onnxruntime, {want!r} expected")
        return 0.0
    if got.dtype != want.dtype:
        raise SystemExit(f"{name}: dtype {got.dtype} from onnxruntime, {want.dtype} expected")
    if want.size == 0:
        return 0.0
    diff = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))
    if not np.allclose(got, want, rtol=tol["rtol"], atol=tol["atol"]):
        raise SystemExit(f"{name}: max abs diff {diff:.3g} is over tolerance {tol}")
    return diff


def verify(fx: Fixture) -> float:
    """Run the model with onnxruntime and compare with the framework reference."""
    sess = cpu_session(fx.model)
    names = [arg.name for arg in sess.get_inputs()]
    if names != list(fx.inputs):
        raise SystemExit(f"{fx.name}: model inputs {names}, reference has {list(fx.inputs)}")
    out_names = [arg.name for arg in sess.get_outputs()]
    results = dict(zip(out_names, sess.run(None, fx.inputs), strict=True))
    worst = 0.0
    for out in out_names:
        got = results[out]
        if out in fx.outputs:
            worst = max(
                worst, _compare(f"{fx.name}/{out}", np.asarray(got), fx.outputs[out], fx.tolerance)
            )
        elif out in fx.json_outputs:
            want_maps = fx.json_outputs[out]
            if len(got) != len(want_maps):
                raise SystemExit(f"{fx.name}/{out}: {len(got)} maps, {len(want_maps)} expected")
            for row, want in zip(got, want_maps, strict=True):
                keys = {str(k): float(v) for k, v in row.items()}
                if sorted(keys) != sorted(want):
                    raise SystemExit(f"{fx.name}/{out}: keys {sorted(keys)} != {sorted(want)}")
                worst = max(
                    worst,
                    _compare(
                        f"{fx.name}/{out}",
                        np.array([keys[k] for k in sorted(want)]),
                        np.array([want[k] for k in sorted(want)]),
                        fx.tolerance,
                    ),
                )
        else:
            raise SystemExit(f"{fx.name}: output {out!r} has no reference")
    print(
        f"  {fx.name}: onnxruntime vs {fx.framework['name']} max abs diff {worst:.3g} "
        f"(tolerance {fx.tolerance})"
    )
    return worst


def _npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """Like np.savez, but with fixed zip timestamps so the bytes are reproducible."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for key, arr in arrays.items():
            if arr.dtype.kind == "O":
                raise SystemExit(f"{key}: object arrays need pickle; use a unicode array")
            member = io.BytesIO()
            np.lib.format.write_array(member, np.require(arr, requirements="C"), allow_pickle=False)
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, member.getvalue())
    return buf.getvalue()


def _model_meta(model: bytes) -> dict[str, Any]:
    proto = onnx.load_from_string(model)
    return {
        "producer_name": proto.producer_name,
        "producer_version": proto.producer_version,
        "ir_version": proto.ir_version,
        "opset_import": {op.domain or "ai.onnx": op.version for op in proto.opset_import},
        "sha256": hashlib.sha256(model).hexdigest(),
    }


def write(fx: Fixture, out: Path, max_diff: float) -> None:
    sess = cpu_session(fx.model)
    arrays = {f"in.{k}": v for k, v in fx.inputs.items()}
    arrays.update({f"out.{k}": v for k, v in fx.outputs.items()})
    meta: dict[str, Any] = {
        "family": fx.family,
        "exporter": fx.exporter,
        "framework": fx.framework,
        "onnx": _model_meta(fx.model),
        "inputs": [arg.name for arg in sess.get_inputs()],
        "outputs": [arg.name for arg in sess.get_outputs()],
        "signature": {
            "inputs": [
                {"name": a.name, "type": a.type, "shape": a.shape} for a in sess.get_inputs()
            ],
            "outputs": [
                {"name": a.name, "type": a.type, "shape": a.shape} for a in sess.get_outputs()
            ],
        },
        "npz_outputs": list(fx.outputs),
        "json_outputs": fx.json_outputs,
        "json_output_key_types": fx.json_output_key_types,
        "tolerance": fx.tolerance,
        "onnxruntime_max_abs_diff": max_diff,
        "onnxruntime_version": ort.__version__,
        "notes": fx.notes,
    }
    npz = _npz_bytes(arrays)
    text = json.dumps(meta, indent=2) + "\n"
    total = len(fx.model) + len(npz) + len(text)
    if total > MAX_FIXTURE_BYTES:
        raise SystemExit(f"{fx.name}: {total} bytes, over the {MAX_FIXTURE_BYTES} byte budget")
    folder = out / fx.name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.onnx").write_bytes(fx.model)
    (folder / "reference.npz").write_bytes(npz)
    (folder / "reference.json").write_text(text)
    print(f"  wrote {folder} ({total} bytes)")


MAKERS: dict[str, Callable[[], Fixture]] = {
    "gpt2": make_gpt2,
    "silero_vad": make_silero_vad,
    "ocr_det": make_ocr_det,
    "sklearn_iris": make_sklearn_iris,
    "sklearn_strings": make_sklearn_strings,
    "sklearn_text": make_sklearn_text,
}


def _reexec_with_fixed_hash_seed() -> None:
    """skl2onnx writes opset_import in set order; fix str hashing so reruns are identical."""
    if os.environ.get("PYTHONHASHSEED") != "0":
        env = dict(os.environ, PYTHONHASHSEED="0")
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="fixture root folder")
    parser.add_argument(
        "--only",
        action="append",
        choices=sorted(MAKERS),
        help="make only this fixture (repeatable)",
    )
    args = parser.parse_args(argv)
    for name in args.only or list(MAKERS):
        print(f"{name}:", flush=True)
        fx = MAKERS[name]()
        write(fx, args.out, verify(fx))
    return 0


if __name__ == "__main__":
    _reexec_with_fixed_hash_seed()
    sys.exit(main())
