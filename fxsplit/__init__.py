"""fxsplit: compiled input-gradient / weight-gradient split of the backward pass.

* ``torch.compile(model, backend="fxsplit")`` (or ``backend=fxsplit.backend(...)``)
  compiles the forward with Inductor and splits the backward ahead of time
  into a dI graph and a dW graph, each compiled by Inductor.
* :func:`stage_backward_input`, :func:`stage_backward_weight` and
  :func:`stage_backward` are drop-ins for ``torch.distributed.pipelining._backward``
  that run those graphs (and an eager split for everything not compiled).
"""

from fxsplit.api import (
    MissingOutputGradError,
    explain,
    stage_backward,
    stage_backward_input,
    stage_backward_weight,
)
from fxsplit.pending import PendingWeightGrads
from fxsplit.backend import BackendOptions, FxsplitCompileError, backend, compiled_regions

__version__ = "0.1.0"

__all__ = [
    "BackendOptions",
    "FxsplitCompileError",
    "MissingOutputGradError",
    "PendingWeightGrads",
    "backend",
    "compiled_regions",
    "explain",
    "stage_backward",
    "stage_backward_input",
    "stage_backward_weight",
]
