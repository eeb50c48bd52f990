"""Benchmark drivers; results land in benchmarks/results/."""
