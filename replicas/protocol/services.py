"""What a replica does through code it is given rather than code it imports: the contracts of
the router's writers it runs, and the bundle that hands them over (``ReplicaServices``).

NOTE: injection. A replica's output goes into structures the router owns in Redis: the
request's response stream, fenced by the dispatcher's lease and deduplicated by position, and
the load reports the dispatchers count slots from. The code that writes them is the router's
(``router/dispatch/stream_writer.py``, ``router/state/load_report.py``), as is the tracing
setup (``router/telemetry/tracing.py``). The replica knows only these Protocols; whoever
builds its deployment (``cluster/app.py``) binds the router's implementations into a
``ReplicaServices``, classes and module-level functions (or ``functools.partial``s of them)
that Ray pickles by reference, so the replica's actor imports them where it runs. A test can
hand it others. The replica never sees a Redis URL, a key or a lease.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from replicas.protocol.call import CallStream
from replicas.protocol.load import ReplicaLoad

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

# a token's logprob in the stream: [token id, logprob, [[alternative id, logprob], ...]]
# (the reader puts in the token texts: router/api/shaper.py)
LogprobWire = list[object]


class StreamSink(Protocol):
    """Where a replica's calls' chunks go: each call's response stream (``CallStream``)."""

    async def write(self, stream: CallStream, text: str, token_ids: Sequence[int],
                    position: int, logprobs: list[LogprobWire] | None, index: int,
                    finish_reason: str | None) -> str | None:
        """Append one chunk, ``position`` being where it brings its choice's output tokens
        (0: a chunk without tokens); why the call must stop now (a ``Halt``), or None."""
        ...

    async def close(self) -> None: ...


class LoadPublisher(Protocol):
    """Publishes a replica's ``ReplicaLoad`` (from the snapshot it was made with) now and then,
    until the replica withdraws it."""

    async def report(self) -> None: ...

    async def run(self) -> None:
        """Report every interval, for ever (the replica cancels it)."""
        ...

    async def withdraw(self, replica_id: str) -> None:
        """Stop counting this replica's slots at once (it is shutting down)."""
        ...


class ReplicaTracing(Protocol):
    """A process's tracer, or none when tracing is off."""

    @property
    def tracer(self) -> Tracer | None: ...

    def shutdown(self) -> None: ...


StreamSinkFactory = Callable[[], StreamSink]
# (the replica's load snapshot, the interval between reports in seconds)
LoadPublisherFactory = Callable[[Callable[[], ReplicaLoad], float], LoadPublisher]
TracingSetup = Callable[[str], ReplicaTracing]  # the default service name -> the tracing


@dataclass(frozen=True, slots=True)
class ReplicaServices:
    """The router's code a replica runs, bound by whoever builds the deployment."""

    stream_sink: StreamSinkFactory
    load_publisher: LoadPublisherFactory
    tracing: TracingSetup
    node_name: Callable[[], str]  # where this process runs, for its load reports
