"""Errors of bringing a cluster up: each message says what failed and what to change."""

from __future__ import annotations


class ClusterStartError(RuntimeError):
    """The cluster cannot start as configured (``fairserve up`` prints it and exits 1)."""


class RedisServerError(ClusterStartError):
    """The embedded server could not be found, started or stopped."""


class PlacementError(ClusterStartError):
    """The replicas and routers ask more of the Ray cluster than it has."""
