"""The daemon itself: wiring, lifecycle, ingress, status and health, reload.

Owns: the start and stop order, turning an incoming message into an admitted request or a
rejection, the requests a crash left stored run again, retained status and inventory, events
and telemetry, health for systemd and `/healthz`, and applying a reloaded configuration.

May import: every other package of the agent; nothing imports it but `agent.cli`.
"""
