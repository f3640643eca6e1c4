"""A small OTLP/HTTP trace receiver (the tests' and the tracing benchmark's): a real HTTP server on a free port that takes
``POST /v1/traces`` (protobuf, optionally gzip), decodes it with ``opentelemetry-proto`` and
keeps the spans."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status_code: int

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def decode(payload: bytes) -> list[ReceivedSpan]:
    request = ExportTraceServiceRequest.FromString(payload)
    out = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                out.append(ReceivedSpan(
                    service=str(resource.get("service.name", "")), name=s.name,
                    trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                    parent_span_id=s.parent_span_id.hex(), start_ns=s.start_time_unix_nano,
                    end_ns=s.end_time_unix_nano,
                    attributes={a.key: _value(a.value) for a in s.attributes},
                    status_code=s.status.code))
    return out


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.num_exports = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                spans = decode(body)
                with receiver._lock:
                    receiver.spans.extend(spans)
                    receiver.num_exports += 1
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def snapshot(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [s for s in self.snapshot() if s.trace_id == trace_id]

    def wait_for(self, predicate: Callable[[list[ReceivedSpan]], bool],
                 timeout_s: float = 30.0) -> list[ReceivedSpan]:
        """The received spans once ``predicate`` holds for them."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.snapshot()
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted({(s.service, s.name) for s in spans})
                raise AssertionError(f"spans not received in {timeout_s} s; have {names}")
            time.sleep(0.1)
