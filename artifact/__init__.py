"""Artifact evaluation: workloads, benchmark driver, simulator runs, plots."""
