"""The model repository and the loaded versions.

Owns: scanning the watched folder and each model's `config.toml`, loading and warming up
versions, leases, hot swap and drain, the file watcher, the backends (ONNX Runtime,
TensorRT with pycuda) and on-box TensorRT engine builds.

May import: `agent.protocol` (errors a request sees), `agent.config`. Never the
connection, delivery or inference packages.
"""
