"""Pure FX graph passes used by fxsplit.

Every pass here takes FX graphs in and returns FX graphs (plus frozen
dataclasses describing them) out. Nothing here holds tensors, touches global
state or calls ``torch.compile``; each pass can be run on a hand-built graph.
"""

from fxsplit.passes.cut import Cut
from fxsplit.passes.first_stage import WeightLeaves
from fxsplit.passes.placement import DEFER_MODES, Placement
from fxsplit.passes.shared import OutputSubset, SharedNode, SplitRuleError
from fxsplit.passes.split import MODES, LiveIn, SplitError, SplitResult, split_backward
from fxsplit.passes.text import normalized_graph_code

__all__ = [
    "DEFER_MODES",
    "MODES",
    "Cut",
    "LiveIn",
    "OutputSubset",
    "Placement",
    "SharedNode",
    "SplitError",
    "SplitResult",
    "SplitRuleError",
    "WeightLeaves",
    "normalized_graph_code",
    "split_backward",
]
