"""Pure FX graph passes used by fxsplit.

Every pass here takes FX graphs in and returns FX graphs (plus frozen
dataclasses describing them) out. Nothing here holds tensors, touches global
state or calls ``torch.compile``; each pass can be run on a hand-built graph.
"""

from fxsplit.passes.shared import OutputSubset, SharedNode, SplitRuleError
from fxsplit.passes.split import LiveIn, SplitError, SplitResult, split_backward
from fxsplit.passes.text import normalized_graph_code

__all__ = [
    "LiveIn",
    "OutputSubset",
    "SharedNode",
    "SplitError",
    "SplitResult",
    "SplitRuleError",
    "normalized_graph_code",
    "split_backward",
]
