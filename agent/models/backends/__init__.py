"""Inference backends, registered by a type key (see :mod:`agent.models.backends.registry`)."""
