"""OpenTelemetry traces of requests across the router, decode and prefill processes.

Off unless a process is given an OTLP endpoint (`--otlp-traces-endpoint`, or the standard
`OTEL_EXPORTER_OTLP_*` variables, read by the CLI): then `setup` installs a tracer provider
whose batch processor exports over OTLP/HTTP; when off nothing of the SDK is imported, no
exporter thread runs, and every call here returns `NOT_TRACED`, whose methods do nothing.

Context crosses processes as a W3C `traceparent` string, in HTTP headers (client -> router ->
decode; a client's own is honoured) and in gRPC metadata (decode -> prefill), and inside a
process as that string (`RequestOptions.trace`), so no layer below needs OpenTelemetry's
types. A stage whose extent is known only once it is over (a queue, a transfer) is recorded
afterwards with its own start and end (`Span.record`), off the hot path.

Lifecycle: `setup` once per process (an atexit hook flushes the spans still queued);
`start` a span where a request enters a process, `record` its stages, `end` it there.
"""

from __future__ import annotations

import atexit
import enum
import logging
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

TRACEPARENT = "traceparent"  # the W3C header (HTTP) and metadata key (gRPC)
_tracer: Any = None  # the process's tracer once `setup` enabled tracing


class Kind(enum.Enum):
    INTERNAL = "internal"
    SERVER = "server"
    CLIENT = "client"


Attributes = Mapping[str, str | int | float | bool]


class Span:
    """A span of a traced request, or (this base class) of an untraced one: nothing."""

    traceparent: str | None = None  # what a child in another process is parented to

    def set(self, attributes: Attributes) -> None:
        pass

    def fail(self, reason: str, message: str) -> None:
        pass

    def record(
        self, name: str, start: float, end: float, attributes: Attributes | None = None
    ) -> None:
        """A finished child stage from `start` to `end` (time.time() seconds)."""

    def end(self, at: float | None = None) -> None:
        pass


NOT_TRACED = Span()


class _LiveSpan(Span):
    def __init__(self, span: Any) -> None:
        from opentelemetry.trace import set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._span = span
        self._context = set_span_in_context(span)
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, context=self._context)
        self.traceparent = carrier.get(TRACEPARENT)

    def set(self, attributes: Attributes) -> None:
        self._span.set_attributes(attributes)

    def fail(self, reason: str, message: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        self._span.set_attribute("pdserve.failure_reason", reason)
        self._span.set_status(Status(StatusCode.ERROR, f"{reason}: {message}"))

    def record(
        self, name: str, start: float, end: float, attributes: Attributes | None = None
    ) -> None:
        child = _tracer.start_span(
            name, context=self._context, attributes=attributes, start_time=_ns(start)
        )
        child.end(end_time=_ns(max(start, end)))

    def end(self, at: float | None = None) -> None:
        self._span.end(end_time=None if at is None else _ns(at))


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def enabled() -> bool:
    return _tracer is not None


def traces_url(endpoint: str) -> str:
    """An OTLP/HTTP endpoint as given (`http://collector:4318`) made the traces URL: a bare
    host gets the signal's path, `/v1/traces`; a URL with a path is taken as it is."""
    if "://" not in endpoint:
        endpoint = "http://" + endpoint
    return (
        endpoint
        if urlsplit(endpoint).path not in ("", "/")
        else endpoint.rstrip("/") + "/v1/traces"
    )


def setup(service: str, endpoint: str | None) -> bool:
    """Enable tracing for this process as `service` (its `service.name`), exporting to
    `endpoint`; None leaves it off. Sampling follows the standard `OTEL_TRACES_SAMPLER`
    (default: every trace, or as the caller's `traceparent` says)."""
    global _tracer
    if endpoint is None:
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    url = traces_url(endpoint)
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
    atexit.register(provider.shutdown)
    _tracer = provider.get_tracer("pdserve")
    logger.info("tracing on: %s exports spans to %s", service, url)
    return True


def start(
    name: str,
    parent: str | None = None,
    kind: Kind = Kind.INTERNAL,
    attributes: Attributes | None = None,
) -> Span:
    """A span begun now, child of the `parent` traceparent (None or unreadable: a new
    trace); `NOT_TRACED` when tracing is off."""
    if _tracer is None:
        return NOT_TRACED
    from opentelemetry.trace import SpanKind
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    context = TraceContextTextMapPropagator().extract({TRACEPARENT: parent} if parent else {})
    span = _tracer.start_span(
        name, context=context, kind=getattr(SpanKind, kind.name), attributes=attributes
    )
    return _LiveSpan(span)
