"""The MQTT connection: the only package that knows paho.

Owns: connecting, the will and birth messages, reconnects with jitter, the epoch, reading
requests off the socket and publishing what the outbox holds within the broker's limits.
paho's private names live in one module of it, checked against the paho versions it was
written for.

May import: paho, `agent.config`, `agent.delivery.outbox`.
"""
