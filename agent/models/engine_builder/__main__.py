"""``python -m agent.models.engine_builder ONNX [options]``: ``edge-agent build-engine``."""

from agent.models.engine_builder.cli import main

if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
