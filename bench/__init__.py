"""Benchmarks (not tests): side-by-side ratios measured in one run."""
