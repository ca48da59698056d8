"""Developer scripts around the benchmark (run from the repository root, e.g. ``python -m benchmarks.graph_times``); results in ``results/``."""
