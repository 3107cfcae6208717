"""edge-stream-agent: serve versioned models on an edge box and stream results over MQTT."""

__version__ = "0.1.0"

__all__ = ["__version__"]
