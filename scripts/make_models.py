#!/usr/bin/env python3
"""Write the example model repository (``models/``) from agent.demo.models.

Idempotent: a file whose bytes would not change is left alone (mtime included), so running
this against the folder of a live agent triggers no reload.

    python scripts/make_models.py [--out DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run from a checkout without installing the package
    sys.path.insert(0, str(REPO_ROOT))

from agent.demo import models as demo_models  # noqa: E402

DECODER_CONFIG = """\
# A GRU decoder run one step at a time; each step's token is streamed as it is made.
[stream]
mode = "steps"
max_steps = 32
feed = { token = "next_token" }
state = { h = "h_out" }
stop = { output = "next_token", value = 0 }
emit = ["next_token", "logits"]
"""

MLP_CONFIG = """\
# The request's leading axis is run and streamed 4 items at a time.
[stream]
mode = "batch"
micro_batch = 4
"""

CLASSIFIER_CONFIG = """\
# One image in, one class score vector out. Requests queued together run as one batch
# (dynamic batching); each still gets its own reply stream.
[batching]
max_batch = 16
max_queue_delay_us = 1000
"""


def build(out: Path) -> list[tuple[Path, bytes]]:
    """Every file of the example repository with its content."""
    mlp = demo_models.to_bytes(demo_models.mlp())
    digest = hashlib.sha256(mlp).hexdigest()
    return [
        (out / "decoder" / "config.toml", DECODER_CONFIG.encode()),
        (out / "decoder" / "1" / "model.onnx", demo_models.to_bytes(demo_models.gru_decoder())),
        (out / "mlp" / "config.toml", MLP_CONFIG.encode()),
        (out / "mlp" / "1" / "model.onnx", mlp),
        (out / "mlp" / "1" / "model.sha256", f"{digest}  model.onnx\n".encode()),
        (out / "classifier" / "config.toml", CLASSIFIER_CONFIG.encode()),
        (out / "classifier" / "1" / "model.onnx", demo_models.to_bytes(demo_models.conv_net())),
    ]


def write(files: list[tuple[Path, bytes]]) -> int:
    """Write what changed (model before checksum, each atomically); return how many."""
    changed = 0
    for path, data in files:
        if path.is_file() and path.read_bytes() == data:
            continue
        demo_models.write_atomic(path, data)
        changed += 1
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO_ROOT / "models",
        help="repository folder (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    files = build(args.out)
    changed = write(files)
    print(f"{args.out}: {changed} of {len(files)} files written, the rest were up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
