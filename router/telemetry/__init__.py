"""Telemetry: Prometheus metrics, OpenTelemetry spans, and each request's timings."""
