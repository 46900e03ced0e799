"""Benchmarks: the timing primitive, the workloads, the harness and its report."""
