"""Benchmarks of fxsplit: ``fxsplit bench`` (see :mod:`benchmarks.bench`) and its models."""
