"""Running it as a service: Prometheus metrics and the HTTP endpoint, systemd, logs.

Modules: `metrics` (the registry, collectors, the telemetry snapshot; `metric_families`: the
hot path's histogram and reply counters), `endpoint`
(the `/metrics` + `/healthz` server), `systemd`, `logs`, `counters`; box telemetry: `box`
(the sampler thread), `jetson` (sysfs readers), `nvml` (discrete GPUs), `energy` (per model).

May import: the standard library, prometheus-client, `agent.config`. Nothing of the request
path: the service hands in what they report.
"""
