"""Benchmark drivers; results land in benchmarks/results/<suite>/ (see its INDEX.md)."""
