"""Workloads for benchmarks and tests: request traces built from public datasets."""
