"""Running it as a service: Prometheus metrics and the HTTP endpoint, systemd, logs.

May import: the standard library, prometheus-client, `agent.config`. Nothing of the request
path: the service hands in what they report.
"""
