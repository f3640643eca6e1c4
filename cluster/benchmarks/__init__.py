"""Benchmarks and probes of the cluster: each a script that prints a table (``python -m
cluster.benchmarks.<name>``; the Makefile's ``bench-*`` targets), and the test helpers they share
(the OTLP receiver, the crash probe). Nothing here is on the request path."""
