"""Dispatch and streams: granting queued requests to replicas, relaying (and migrating) each
one, and the Redis response streams its client's router reads."""
