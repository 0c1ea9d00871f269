"""Benchmarks: figures printed next to the limit they are measured against, in the same run."""
