"""Tracing is configured by the standard OTEL_* variables and off unless asked for."""

from __future__ import annotations

import pytest

from router.telemetry.tracing import OFF, configure_tracing, decode_meta, encode_meta, is_requested


@pytest.mark.parametrize(("env", "expected"), [
    ({}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
    ({"OTEL_TRACES_EXPORTER": "console"}, True),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False),
])
def test_is_requested(env: dict[str, str], expected: bool) -> None:
    assert is_requested(env) is expected


def test_off_by_default_has_no_tracer() -> None:
    assert configure_tracing("x", {}) is OFF and not OFF.is_on


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_otlp_over_http_and_grpc(protocol: str) -> None:
    tracing = configure_tracing("fairserve-test", {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_SERVICE_NAME": "named"})
    try:
        assert tracing.is_on and tracing.provider is not None
        assert tracing.provider.resource.attributes["service.name"] == "named"
        processor = tracing.provider._active_span_processor._span_processors[0]
        exporter = processor._batch_processor._exporter
        assert type(exporter).__module__.startswith(
            "opentelemetry.exporter.otlp.proto." + ("grpc" if protocol == "grpc" else "http"))
    finally:
        tracing.shutdown()


def test_unknown_protocol_or_exporter_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_PROTOCOL"):
        configure_tracing("x", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c",
                                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER"):
        configure_tracing("x", {"OTEL_TRACES_EXPORTER": "zipkin"})


def test_meta_carries_the_context_and_the_admission_instant() -> None:
    meta = encode_meta({"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"}, 123)
    assert decode_meta(meta) == {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01",
                                 "admitted_ns": 123}
    assert decode_meta("") == {} and decode_meta("[1]") == {} and decode_meta("{bad") == {}
