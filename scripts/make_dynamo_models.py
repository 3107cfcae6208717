#!/usr/bin/env python3
"""Dev-only: regenerate ``tests/fixtures/real/torch_dynamo/``: small seeded torch models
exported by ``torch.onnx.export`` as it behaves by default since torch 2.9 (the dynamo exporter:
``torch.export``, opset 18 or later, weights in a ``model.onnx.data`` file beside the graph).

Not run by CI. Needs torch and onnxscript (the exporter's dependency) besides onnx and
onnxruntime, e.g. in ``.venv-export`` (scripts/export-requirements.txt)::

    .venv-export/bin/python scripts/make_dynamo_models.py [--out tests/fixtures/real/torch_dynamo]

Each folder is a model as a user drops it in the models folder, with what the tests compare:

- ``model.onnx`` and ``model.onnx.data``: as the exporter wrote them;
- ``config.toml``: the agent's config for it (``whole``, ``steps`` or ``scan``);
- ``reference.npz``: ``in.<name>`` the request's inputs, ``out.<name>`` torch's own outputs for
  the whole stream (a loop in torch for ``steps`` and ``scan``, stacked on a leading axis);
  for ``vad`` also ``in.pcm``, the first recording as 16-bit samples, and ``out.pcm_prob``,
  torch's loop over them as a pcm source reads them;
- ``reference.json``: the exporter, versions and the largest ONNX Runtime / torch difference.

The three: ``classifier`` (a small CNN, softmax over 5 classes, dynamic batch), ``decoder_step``
(an embedding + GRU cell step, its arg max and hidden state fed back) and ``vad`` (a strided
conv + LSTM cell over silero-vad's 576-sample windows, its state ``[2, batch, 32]`` carried).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures" / "real" / "torch_dynamo"
TOLERANCE = 1e-5
STEPS = 6
WINDOW, HOP, LEAD = 576, 512, 64  # as silero-vad's own wrapper feeds it
SAMPLES = 5 * HOP + 100  # five whole windows and a partial one (dropped)


class Classifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.fc = torch.nn.Linear(16, 5)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv2(torch.relu(self.conv1(images))))
        return torch.softmax(self.fc(x.mean(dim=(2, 3))), dim=-1)


class DecoderStep(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.cell = torch.nn.GRUCell(16, 24)
        self.head = torch.nn.Linear(24, 32)

    def forward(
        self, token: torch.Tensor, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h_out = self.cell(self.embed(token), h)
        logits = self.head(h_out)
        return logits.argmax(-1), h_out, logits


class Vad(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(1, 16, 64, stride=32)
        self.cell = torch.nn.LSTMCell(16, 32)
        self.head = torch.nn.Linear(32, 1)

    def forward(
        self, input: torch.Tensor, state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.relu(self.conv(input.unsqueeze(1))).mean(-1)
        h, c = self.cell(x, (state[0], state[1]))
        return torch.sigmoid(self.head(h)), torch.stack([h, c])


def classifier() -> tuple[torch.nn.Module, dict[str, Any]]:
    model = Classifier().eval()
    images = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        probs = model(images)
    return model, {
        "args": (images,),
        "inputs": ["images"],
        "outputs": ["probs"],
        "dynamic": {"images": {0: "batch"}},
        "request": {"images": images.numpy()},
        "reference": {"probs": probs.numpy()},
        "config": "",
    }


def decoder_step() -> tuple[torch.nn.Module, dict[str, Any]]:
    model = DecoderStep().eval()
    token, h = torch.tensor([1, 2]), torch.zeros(2, 24)
    tokens, logits = [], []
    with torch.no_grad():  # the stream: each step's arg max and hidden state fed back
        for _ in range(STEPS):
            token, h, step_logits = model(token, h)
            tokens.append(token.numpy())
            logits.append(step_logits.numpy())
    config = (
        '[stream]\nmode = "steps"\n'
        f"max_steps = {STEPS}\n"
        'feed = { token = "next_token" }\n'
        'state = { h = "h_out" }\n'
        'emit = ["next_token", "logits"]\n'
    )
    return model, {
        "args": (torch.tensor([1, 2]), torch.zeros(2, 24)),
        "inputs": ["token", "h"],
        "outputs": ["next_token", "h_out", "logits"],
        "dynamic": {"token": {0: "batch"}, "h": {0: "batch"}},
        "request": {"token": np.array([1, 2], np.int64), "h": np.zeros((2, 24), np.float32)},
        "reference": {"next_token": np.stack(tokens), "logits": np.stack(logits)},
        "config": config,
    }


def vad() -> tuple[torch.nn.Module, dict[str, Any]]:
    model = Vad().eval()
    signal = torch.rand(2, SAMPLES) * 2 - 1
    probs = windows_through(model, signal)
    # The first recording as a pcm source reads it: 16-bit samples, mono, as floats in [-1, 1)
    pcm = (signal[0].numpy() * 32767).astype("<i2")
    pcm_probs = windows_through(model, torch.from_numpy(pcm.astype(np.float32) / 32768)[None])
    config = (
        '[stream]\nmode = "scan"\n'
        'state = { state = "state_out" }\n\n'
        f'[scan]\ninput = "input"\nwindow = {WINDOW}\nhop = {HOP}\nlead = {LEAD}\n'
    )
    return model, {
        "args": (torch.zeros(2, WINDOW), torch.zeros(2, 2, 32)),
        "inputs": ["input", "state"],
        "outputs": ["prob", "state_out"],
        "dynamic": {"input": {0: "batch"}, "state": {1: "batch"}},
        "request": {"input": signal.numpy(), "pcm": pcm},
        "reference": {"prob": probs, "pcm_prob": pcm_probs},
        "config": config,
    }


def windows_through(model: torch.nn.Module, signal: torch.Tensor) -> np.ndarray:
    """The model over `signal`'s windows, its state carried: window k is
    `signal[:, k*HOP - LEAD : k*HOP - LEAD + WINDOW]`, zeros before 0, a partial one dropped;
    the outputs stacked on a new leading axis."""
    padded = torch.cat([torch.zeros(signal.shape[0], LEAD), signal], dim=1)
    state = torch.zeros(2, signal.shape[0], 32)
    probs = []
    with torch.no_grad():
        for start in range(0, padded.shape[1] - WINDOW + 1, HOP):
            prob, state = model(padded[:, start : start + WINDOW], state)
            probs.append(prob.numpy())
    return np.stack(probs)


MAKERS: dict[str, Callable[[], tuple[torch.nn.Module, dict[str, Any]]]] = {
    "classifier": classifier,
    "decoder_step": decoder_step,
    "vad": vad,
}


def export(model: torch.nn.Module, spec: dict[str, Any], folder: Path) -> None:
    """`torch.onnx.export` with its defaults (the dynamo exporter, external data)."""
    dims = {
        name: {axis: torch.export.Dim(label, min=1, max=64) for axis, label in axes.items()}
        for name, axes in spec["dynamic"].items()
    }
    torch.onnx.export(
        model,
        spec["args"],
        str(folder / "model.onnx"),
        input_names=spec["inputs"],
        output_names=spec["outputs"],
        dynamic_shapes=dims,
    )
    if not (folder / "model.onnx.data").exists():
        raise SystemExit(f"{folder.name}: the exporter wrote no external data file")


def first_run_difference(folder: Path, spec: dict[str, Any]) -> float:
    """ONNX Runtime against torch on the export's own example (one run, every output)."""
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    feed = {name: arg.numpy() for name, arg in zip(spec["inputs"], spec["args"], strict=True)}
    got = session.run(None, feed)
    with torch.no_grad():
        want = spec["model"](*spec["args"])
    want = want if isinstance(want, tuple) else (want,)
    return max(
        float(np.abs(g.astype(np.float64) - w.numpy().astype(np.float64)).max())
        for g, w in zip(got, want, strict=True)
    )


def make(name: str, out: Path) -> None:
    torch.manual_seed(0)
    model, spec = MAKERS[name]()
    spec["model"] = model
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    export(model, spec, folder)
    difference = first_run_difference(folder, spec)
    if difference > TOLERANCE:
        raise SystemExit(f"{name}: onnxruntime differs from torch by {difference}")
    (folder / "config.toml").write_text(spec["config"])
    arrays = {f"in.{k}": v for k, v in spec["request"].items()}
    arrays.update({f"out.{k}": v for k, v in spec["reference"].items()})
    np.savez(folder / "reference.npz", **arrays)  # type: ignore[arg-type]
    meta = {
        "exporter": "torch.onnx.export, defaults (dynamo exporter, external data)",
        "torch": importlib.metadata.version("torch"),
        "onnxscript": importlib.metadata.version("onnxscript"),
        "onnxruntime": ort.__version__,
        "tolerance": TOLERANCE,
        "onnxruntime_max_abs_diff": difference,
    }
    (folder / "reference.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"{name}: wrote {folder} (onnxruntime - torch: {difference:.2e})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    out: Path = parser.parse_args().out
    for name in MAKERS:
        make(name, out)


if __name__ == "__main__":
    main()
