"""fxsplit: compiled input-gradient / weight-gradient split of the backward pass.

* ``torch.compile(model, backend="fxsplit")`` (or ``backend=fxsplit.backend(...)``)
  compiles the forward with Inductor and splits the backward ahead of time
  into a dI graph and a dW graph, each compiled by Inductor.
* :func:`stage_backward_input`, :func:`stage_backward_weight` and
  :func:`stage_backward` are drop-ins for ``torch.distributed.pipelining._backward``
  that run those graphs (and an eager split for everything not compiled).
* :func:`register_split_rule` declares how to split a backward op that returns
  input and weight gradients from one call; :func:`fallbacks` lists regions
  that could not be compiled; ``fxsplit.config`` holds process-wide defaults.
"""

from fxsplit import config
from fxsplit.api import (
    MissingOutputGradError,
    explain,
    stage_backward,
    stage_backward_input,
    stage_backward_weight,
)
from fxsplit.backend import BackendOptions, FallbackRecord, FxsplitCompileError, backend, compiled_regions, fallbacks
from fxsplit.pending import PendingWeightGrads
from fxsplit.rules import KEEP_IN_DI, register_split_rule, split_rules, unregister_split_rule

__version__ = "0.1.0"

__all__ = [
    "BackendOptions",
    "KEEP_IN_DI",
    "FallbackRecord",
    "FxsplitCompileError",
    "MissingOutputGradError",
    "PendingWeightGrads",
    "backend",
    "compiled_regions",
    "config",
    "explain",
    "fallbacks",
    "register_split_rule",
    "split_rules",
    "stage_backward",
    "stage_backward_input",
    "stage_backward_weight",
    "unregister_split_rule",
]
