"""Benchmarks: every layer measured against the roofline and the baselines (imported by nobody)."""
