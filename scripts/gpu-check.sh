#!/usr/bin/env bash
# The GPU check of the TensorRT path (scripts/gpu_check.py): build engines on this machine,
# compare with ONNX Runtime, run from several threads, swap engines and watch device memory.
# Installs nothing and reaches no network: it uses the Python that is here (.venv if there
# is one, else python3; PYTHON=... to choose). Where tensorrt is not importable it says so
# and exits 0. Arguments are passed on (--json FILE, --swaps N, --workdir DIR, ...).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
echo "gpu-check: $("$PY" --version 2>&1) at $(command -v "$PY" || echo "$PY")"
# The agent's own dependencies (numpy, onnx, ...) must be importable: a bare python3 has none.
if ! missing=$(PYTHONPATH="$PWD" "$PY" - 2>&1 <<'PYCHECK'
import importlib.util, sys
need = ["numpy", "onnx", "cbor2", "pydantic", "agent"]
gone = [name for name in need if importlib.util.find_spec(name) is None]
print(" ".join(gone))
sys.exit(1 if gone else 0)
PYCHECK
); then
    echo "gpu-check: $PY cannot import: $missing" >&2
    echo "gpu-check: run scripts/bootstrap (a .venv with the agent), or" \
        "'$PY -m pip install -e .[gpu]', or choose an interpreter with PYTHON=..." >&2
    exit 2
fi
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null \
        | sed 's/^/gpu-check: nvidia-smi: /'
elif [ -r /etc/nv_tegra_release ]; then
    echo "gpu-check: $(head -n 1 /etc/nv_tegra_release)"
else
    echo "gpu-check: no nvidia-smi and no /etc/nv_tegra_release: probably no NVIDIA GPU here"
fi
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" scripts/gpu_check.py "$@"
