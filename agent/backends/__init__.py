"""Inference backends, registered by a type key (see :mod:`agent.backends.registry`)."""
