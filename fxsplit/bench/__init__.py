"""The ``fxsplit bench`` benchmark (:mod:`fxsplit.bench.run`) and its models (:mod:`fxsplit.bench.models`).

Installed with fxsplit so that the console script works from a wheel; results
and developer-only scripts stay in the repository's ``benchmarks/`` folder.
"""
