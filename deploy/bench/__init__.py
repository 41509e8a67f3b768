"""Benchmarks: workloads, load generators and the figures they record."""
