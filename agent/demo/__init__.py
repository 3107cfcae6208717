"""`edge-agent demo` and what tests and benchmarks build on: small real ONNX models made in
code, and a private Mosquitto on a free port.

May import: `agent.service`, `agent.client`, `agent.config` (the demo runs a whole agent).
"""
