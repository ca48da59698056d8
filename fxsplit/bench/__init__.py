"""The ``fxsplit bench`` benchmark, one module per concern.

:mod:`~fxsplit.bench.run` runs every mode and section and returns the result;
:mod:`~fxsplit.bench.settings` checks the options and says where results go;
:mod:`~fxsplit.bench.models` builds the stages; :mod:`~fxsplit.bench.modes`
runs a step of each of the six modes and counts its FLOPs and memory;
:mod:`~fxsplit.bench.baselines` holds upstream's split and the private torch
APIs the baselines need; :mod:`~fxsplit.bench.timing` times a step;
the sections are :mod:`~fxsplit.bench.host_time`,
:mod:`~fxsplit.bench.accumulate`, :mod:`~fxsplit.bench.memory` and
:mod:`~fxsplit.bench.compile_time` (with :mod:`~fxsplit.bench.allocator` for
page faults); :mod:`~fxsplit.bench.targets` gives the verdicts,
:mod:`~fxsplit.bench.report` the table, :mod:`~fxsplit.bench.chart` the PNG,
:mod:`~fxsplit.bench.progress` the progress lines and
:mod:`~fxsplit.bench.flops` the FLOP formulas. The command line is
:mod:`fxsplit.cli`.

Installed with fxsplit so that the console script works from a wheel; results
and developer-only scripts stay in the repository's ``benchmarks/`` folder.
"""
