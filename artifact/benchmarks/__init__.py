"""Micro-benchmarks: each runnable as `python -m artifact.benchmarks.<name>`, writing JSON under
artifact/results/ and printing a short table."""
