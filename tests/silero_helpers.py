"""The silero-vad fixture (tests/fixtures/real/silero_vad, the model as silero ships it) as a
`mode = "scan"` model, and the plain ONNX Runtime loop its windows are checked against. Used
by the scan and pcm-source tests and by the scan benchmark, so all three cut the same windows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt

SILERO = Path(__file__).resolve().parent / "fixtures" / "real" / "silero_vad" / "model.onnx"
RATE = 16000
WINDOW, HOP, LEAD = 576, 512, 64  # silero's 512-sample hop with its 64 samples of context


def scan_config(extra: str = "") -> str:
    """The model's config.toml: windows of the `input`, `state` carried, `sr` defaulted;
    `extra`: more `[scan]` keys (`tail = "pad"`, `windows_per_chunk = 4`)."""
    return f"""\
[stream]
mode = "scan"
state = {{ state = "stateN" }}

[scan]
input = "input"
window = {WINDOW}
hop = {HOP}
lead = {LEAD}
{extra}
[defaults]
sr = {RATE}
"""


def reference(signal: npt.NDArray[np.float32], *, pad: bool = False) -> npt.NDArray[np.float32]:
    """A plain onnxruntime loop: window k = signal[k*512-64 : k*512+512] (zeros before 0),
    state carried; one [batch, 1] output per window, stacked. `signal` is [batch, samples];
    without `pad` a last partial window is dropped, with it it is padded with zeros."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(SILERO), providers=["CPUExecutionProvider"])
    batch, length = signal.shape
    padded = np.concatenate([np.zeros((batch, LEAD), np.float32), signal], axis=1)
    count = (length - (WINDOW - LEAD)) // HOP + 1
    if pad and length > (count - 1) * HOP - LEAD + WINDOW:
        count += 1
        padded = np.concatenate([padded, np.zeros((batch, WINDOW), np.float32)], axis=1)
    state = np.zeros((2, batch, 128), np.float32)
    outputs = []
    for k in range(count):
        window = np.ascontiguousarray(padded[:, k * HOP : k * HOP + WINDOW])
        out, state = session.run(
            None, {"input": window, "state": state, "sr": np.array(RATE, np.int64)}
        )
        outputs.append(out)
    return np.stack(outputs)
