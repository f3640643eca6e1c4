"""Ray's own background work, turned down (``ray.quiet``, on by default).

An idle cluster of ``make up``'s shape took 127-138 ms of CPU a second on a 2-core EPYC before
any request (the Serve controller's loop every 0.1 s 35-37 ms/s and the GCS it asks 16; the
router and the model replica 16-18 and 12-14 each, mostly Ray's core worker; Ray's proxy,
HAProxy's manager, the dashboard agent, the log monitor and the raylet 7-10 each). On a CPU replica all of
it is taken from the engine's threads, which wait for each other at every step, so a stream's
tokens come slower for it; on a GPU node it is CPU the routers could use. With these variables
the same idle cluster took 78-94 ms/s (``docs/benchmarks.md``, "Ray's idle work").

What is given up: Ray's task records (its dashboard's task list and timeline, ``ray list
tasks``), the C++ event loops' own statistics, and Ray's Prometheus metrics (Ray Serve's and
Ray's; fairserve's ``/metrics`` is its own and stays); the Serve controller notices a change (a
replica up or gone, a scaling decision) up to 0.5 s later instead of 0.1 s. ``ray.quiet: false``
keeps Ray's defaults. The launcher sets these for a local Ray; the chart sets them on every
Ray pod (``ray.quiet`` there), but for Ray's metrics, which stay on there for its PodMonitor.
Ray's processes read them when they start.
"""

from __future__ import annotations

QUIET_ENV: dict[str, str] = {
    "RAY_enable_task_events": "0",  # a record of every task (each replica call) to the GCS
    "RAY_event_stats": "0",  # the C++ event loops' statistics of their own handlers
    "RAY_enable_metrics_collection": "0",  # Ray's and Ray Serve's Prometheus metrics
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",  # the Serve controller's loop (0.1 s)
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",  # Serve's cached metrics, flushed (100 ms)
}
