"""Golden graphs: the dI graph, the dW graph and the live-ins for a few canonical blocks.

Each block is compiled with ``fxsplit.backend(compiler="eager")``; the split
of its backward graph is read from ``fxsplit.compiled_regions()[-1].split`` and
compared, as ``fxsplit.passes.normalized_graph_code`` text, with the strings inline
below (``expecttest.TestCase.assertExpectedInline``). The live-ins text ends
with the bytes they hold and what the all-crossing cut would hold.

What to look for: with the default placement (``defer="matmuls"``) bias and
LayerNorm/RMSNorm weight gradients are ``sum`` reductions in dI whose small
results cross, and every weight-gradient ``mm`` is in dW; with
``defer="all"`` the reductions are in dW; the cut recomputes an upcast in dW
instead of holding the wide value; a first stage's dI runs the
activation-gradient chain.

The goldens are tied to the torch release CI pins (torch==2.13.0): AOTAutograd's
decompositions and partitioner decide the exact ops, so other releases produce
other (equally correct) graphs, and these tests are skipped there. After an
intended change (or a torch bump), refresh them in place with::

    EXPECTTEST_ACCEPT=1 python -m pytest tests/test_golden.py

and review the diff of this file.
"""

from __future__ import annotations

import unittest
from typing import Any

import expecttest
import sympy
import torch
import torch._dynamo
import torch.nn as nn

import fxsplit
import zoo
from fxsplit.passes import normalized_graph_code

GOLDEN_TORCH = "2.13.0"


def split_of(
    module: nn.Module, *inputs: torch.Tensor, dynamic: bool | None = None, **options: Any
) -> tuple[str, str, str]:
    """(dI code, dW code, live-ins and bytes) of the backward of ``module``
    compiled on ``inputs``; ``options`` go to ``fxsplit.backend``."""
    torch._dynamo.reset()
    before = fxsplit.compiled_regions()
    backend = fxsplit.backend(compiler="eager", fallback="error", **options)
    cm = torch.compile(module, backend=backend, dynamic=dynamic)
    cm(*inputs)
    regions = [r for r in fxsplit.compiled_regions() if not any(r is b for b in before)]
    assert len(regions) == 1, f"expected one compiled region, got {len(regions)}"
    split = regions[0].split
    live = "".join(f"{l}\n" for l in split.live_ins)
    live += f"bytes: {_canonical(split.live_in_bytes_expr)} (all-crossing: {_canonical(split.all_crossing_bytes_expr)})\n"
    return normalized_graph_code(split.di_graph), normalized_graph_code(split.dw_graph), live


def _canonical(expr: sympy.Expr) -> str:
    """``expr`` with its size symbols renamed b0, b1... in sorted order (Dynamo's
    symbol numbers vary with what was traced before)."""
    symbols = sorted(expr.free_symbols, key=lambda s: (len(str(s)), str(s)))
    return str(expr.subs({s: sympy.Symbol(f"b{k}", positive=True, integer=True) for k, s in enumerate(symbols)}))


class RMSNormLinear(nn.Module):
    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(d, eps=1e-6)
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x))


class Upcast(nn.Module):
    """A bfloat16 activation computed on in float32 (the backward upcasts its tangent)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.float()).to(x.dtype)


class SharedWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.fc(x)))


@unittest.skipUnless(
    torch.__version__.split("+")[0] == GOLDEN_TORCH,
    f"golden graphs are pinned to torch {GOLDEN_TORCH}, the version CI installs (.ci/run); this is torch "
    f"{torch.__version__}. To move them to this release: set GOLDEN_TORCH in tests/test_golden.py, run "
    f"EXPECTTEST_ACCEPT=1 python -m pytest tests/test_golden.py, review the diff, and pin CI to it",
)
class TestGoldenSplit(expecttest.TestCase):
    def setUp(self) -> None:
        torch.manual_seed(0)

    def tearDown(self) -> None:
        torch._dynamo.reset()

    def test_linear(self) -> None:
        di, dw, live = split_of(nn.Linear(4, 3), torch.randn(4, 4, requires_grad=True))
        self.assertExpectedInline(di, """\
in0 = input()
in1 = input()
in2 = input()
v0 = aten.permute.default(in0, [1, 0])
v1 = aten.permute.default(v0, [1, 0])
v2 = aten.mm.default(in2, v1)
v3 = aten.sum.dim_IntList(in2, [0], True)
return (v2, in1, in2, v3)
""")
        self.assertExpectedInline(dw, """\
in0 = input()
in1 = input()
in2 = input()
v0 = aten.permute.default(in1, [1, 0])
v1 = aten.mm.default(v0, in0)
v2 = aten.view.default(in2, [3])
return (v1, v2)
""")
        self.assertExpectedInline(live, """\
primals_3 (input, tensor)
tangents_1 (input, tensor)
sum_1 (dI, tensor)
bytes: 124 (all-crossing: 124)
""")

    def test_mlp(self) -> None:
        di, dw, live = split_of(zoo.MLP(4, 8), torch.randn(4, 4, requires_grad=True))
        self.assertExpectedInline(di, """\
in0 = input()
in1 = input()
in2 = input()
in3 = input()
in4 = input()
in5 = input()
v0 = aten.permute.default(in2, [1, 0])
v1 = aten.permute.default(v0, [1, 0])
v2 = aten.mm.default(in5, v1)
v3 = aten.sum.dim_IntList(in5, [0], True)
v4 = aten.mul.Tensor(in3, 0.7071067811865476)
v5 = aten.erf.default(v4)
v6 = aten.add.Tensor(v5, 1)
v7 = aten.mul.Tensor(v6, 0.5)
v8 = aten.mul.Tensor(in3, in3)
v9 = aten.mul.Tensor(v8, -0.5)
v10 = aten.exp.default(v9)
v11 = aten.mul.Tensor(v10, 0.3989422804014327)
v12 = aten.mul.Tensor(in3, v11)
v13 = aten.add.Tensor(v7, v12)
v14 = aten.mul.Tensor(v2, v13)
v15 = aten.permute.default(in0, [1, 0])
v16 = aten.permute.default(v15, [1, 0])
v17 = aten.mm.default(v14, v16)
v18 = aten.sum.dim_IntList(v14, [0], True)
return (v17, in1, in4, in5, v3, v14, v18)
""")
        self.assertExpectedInline(dw, """\
in0 = input()
in1 = input()
in2 = input()
in3 = input()
in4 = input()
in5 = input()
v0 = aten.permute.default(in2, [1, 0])
v1 = aten.mm.default(v0, in1)
v2 = aten.view.default(in3, [4])
v3 = aten.permute.default(in4, [1, 0])
v4 = aten.mm.default(v3, in0)
v5 = aten.view.default(in5, [8])
return (v4, v5, v1, v2)
""")
        self.assertExpectedInline(live, """\
primals_3 (input, tensor)
mul_2 (input, tensor)
tangents_1 (input, tensor)
sum_1 (dI, tensor)
mul_9 (dI, tensor)
sum_2 (dI, tensor)
bytes: 432 (all-crossing: 432)
""")

    def test_mlp_3d_dynamic(self) -> None:
        """``[batch, seq, dim]`` with ``dynamic=True``: dW reads ``[batch*seq, .]``
        tensors, so it also takes the SymInts of batch and seq (the first two live-ins)."""
        _, dw, live = split_of(zoo.MLP(4, 8), torch.randn(2, 3, 4, requires_grad=True), dynamic=True)
        self.assertExpectedInline(dw, """\
in0 = input()
in1 = input()
in2 = input()
in3 = input()
in4 = input()
in5 = input()
in6 = input()
in7 = input()
v0 = aten.permute.default(in4, [1, 0])
v1 = aten.mm.default(v0, in3)
v2 = aten.view.default(in5, [4])
v3 = aten.permute.default(in6, [1, 0])
v4 = aten.mm.default(v3, in2)
v5 = aten.view.default(in7, [8])
return (v4, v5, v1, v2)
""")
        self.assertExpectedInline(live, """\
primals_3 (input, symint)
primals_4 (input, symint)
view (input, tensor)
view_2 (input, tensor)
view_4 (dI, tensor)
sum_1 (dI, tensor)
view_7 (dI, tensor)
sum_2 (dI, tensor)
bytes: 96*b0*b1 + 48 (all-crossing: 96*b0*b1 + 48)
""")

    def test_layernorm_linear(self) -> None:
        di, dw, live = split_of(zoo.LayerNormLinear(4), torch.randn(4, 4, requires_grad=True))
        self.assertExpectedInline(di, """\
in0 = input()
in1 = input()
in2 = input()
in3 = input()
in4 = input()
v0 = aten.permute.default(in2, [1, 0])
v1 = aten.permute.default(v0, [1, 0])
v2 = aten.mm.default(in4, v1)
v3 = aten.sum.dim_IntList(in4, [0], True)
v4 = aten.mul.Tensor(v2, in0)
v5 = aten.mul.Tensor(v4, 4)
v6 = aten.sum.dim_IntList(v4, [1], True)
v7 = aten.var_mean.correction(in1, [1], correction=0, keepdim=True)
v8 = getitem(v7, 0)
v9 = getitem(v7, 1)
v10 = aten.add.Tensor(v8, 1e-05)
v11 = aten.rsqrt.default(v10)
v12 = aten.sub.Tensor(in1, v9)
v13 = aten.mul.Tensor(v12, v11)
v14 = aten.mul.Tensor(v4, v13)
v15 = aten.sum.dim_IntList(v14, [1], True)
v16 = aten.mul.Tensor(v13, v15)
v17 = aten.sub.Tensor(v5, v6)
v18 = aten.sub.Tensor(v17, v16)
v19 = aten.div.Tensor(v11, 4)
v20 = aten.mul.Tensor(v19, v18)
v21 = aten.mul.Tensor(v2, v13)
v22 = aten.sum.dim_IntList(v21, [0])
v23 = aten.sum.dim_IntList(v2, [0])
return (v20, in3, in4, v3, v22, v23)
""")
        self.assertExpectedInline(dw, """\
in0 = input()
in1 = input()
in2 = input()
in3 = input()
in4 = input()
v0 = aten.permute.default(in1, [1, 0])
v1 = aten.mm.default(v0, in0)
v2 = aten.view.default(in2, [4])
return (in3, in4, v1, v2)
""")
        self.assertExpectedInline(live, """\
add_1 (input, tensor)
tangents_1 (input, tensor)
sum_1 (dI, tensor)
sum_4 (dI, tensor)
sum_5 (dI, tensor)
bytes: 176 (all-crossing: 176)
""")

    def test_linear_defer_all(self) -> None:
        """Strict placement: the bias gradient's sum stays in dW."""
        _, dw, live = split_of(nn.Linear(4, 3), torch.randn(4, 4, requires_grad=True), defer="all")
        self.assertExpectedInline(dw, """\
in0 = input()
in1 = input()
v0 = aten.permute.default(in1, [1, 0])
v1 = aten.mm.default(v0, in0)
v2 = aten.sum.dim_IntList(in1, [0], True)
v3 = aten.view.default(v2, [3])
return (v1, v3)
""")
        self.assertExpectedInline(live, """\
primals_3 (input, tensor)
tangents_1 (input, tensor)
bytes: 112 (all-crossing: 112)
""")

    def test_rmsnorm_linear(self) -> None:
        """The RMSNorm weight gradient and the Linear's bias gradient are
        reductions in dI; dW is the one weight matmul."""
        di, dw, live = split_of(RMSNormLinear(4), torch.randn(4, 4, requires_grad=True))
        self.assertExpectedInline(di, """\
in0 = input()
in1 = input()
in2 = input()
in3 = input()
in4 = input()
v0 = aten.permute.default(in2, [1, 0])
v1 = aten.permute.default(v0, [1, 0])
v2 = aten.mm.default(in4, v1)
v3 = aten.sum.dim_IntList(in4, [0], True)
v4 = aten.pow.Tensor_Scalar(in1, 2)
v5 = aten.mean.dim(v4, [1], True)
v6 = aten.add.Scalar(v5, 9.999999974752427e-07)
v7 = aten.rsqrt.default(v6)
v8 = aten.mul.Tensor(in1, v7)
v9 = aten.mul.Tensor(v2, v8)
v10 = aten.mul.Tensor(v2, in0)
v11 = aten.sum.dim_IntList(v9, [0], True)
v12 = aten.mul.Tensor(v10, in1)
v13 = aten.mul.Tensor(v10, v7)
v14 = aten.sum.dim_IntList(v12, [1], True)
v15 = aten.pow.Tensor_Scalar(v7, 3)
v16 = aten.mul.Scalar(v14, -0.5)
v17 = aten.mul.Tensor(v16, v15)
v18 = aten.expand.default(v17, [4, 4])
v19 = aten.div.Scalar(v18, 4)
v20 = aten.pow.Tensor_Scalar(in1, 1.0)
v21 = aten.mul.Scalar(v20, 2.0)
v22 = aten.mul.Tensor(v19, v21)
v23 = aten.add.Tensor(v13, v22)
return (v23, in3, in4, v3, v11)
""")
        self.assertExpectedInline(dw, """\
in0 = input()
in1 = input()
in2 = input()
in3 = input()
v0 = aten.permute.default(in1, [1, 0])
v1 = aten.mm.default(v0, in0)
v2 = aten.view.default(in2, [4])
v3 = aten.view.default(in3, [4])
return (v3, v1, v2)
""")
        self.assertExpectedInline(live, """\
mul_1 (input, tensor)
tangents_1 (input, tensor)
sum_1 (dI, tensor)
sum_2 (dI, tensor)
bytes: 160 (all-crossing: 160)
""")

    def test_upcast_recomputed_in_dw(self) -> None:
        """The bfloat16 tangent crosses; dW upcasts it again rather than holding
        the float32 copy dI made."""
        di, dw, live = split_of(Upcast(), torch.randn(8, 4).to(torch.bfloat16).requires_grad_())
        self.assertExpectedInline(di, """\
in0 = input()
in1 = input()
in2 = input()
v0 = prims.convert_element_type.default(in2, torch.float32)
v1 = aten.permute.default(in0, [1, 0])
v2 = aten.permute.default(v1, [1, 0])
v3 = aten.mm.default(v0, v2)
v4 = prims.convert_element_type.default(v3, torch.bfloat16)
return (v4, in1, in2)
""")
        self.assertExpectedInline(dw, """\
in0 = input()
in1 = input()
v0 = prims.convert_element_type.default(in1, torch.float32)
v1 = aten.permute.default(v0, [1, 0])
v2 = aten.mm.default(v1, in0)
return (v2,)
""")
        self.assertExpectedInline(live, """\
convert_element_type (input, tensor)
tangents_1 (input, tensor)
bytes: 192 (all-crossing: 256)
""")

    def test_first_stage_input_without_grad(self) -> None:
        """A first stage: dI runs the activation-gradient chain (fc2's input
        matmul, GELU's backward) and the two bias reductions; dW only the two
        weight matmuls. fc1's pre-activation and fc2's weight are not kept for W."""
        di, dw, live = split_of(zoo.MLP(4, 8), torch.randn(4, 4))
        self.assertExpectedInline(di, """\
in0 = input()
in1 = input()
in2 = input()
in3 = input()
in4 = input()
v0 = aten.permute.default(in1, [1, 0])
v1 = aten.permute.default(v0, [1, 0])
v2 = aten.mm.default(in4, v1)
v3 = aten.sum.dim_IntList(in4, [0], True)
v4 = aten.mul.Tensor(in2, 0.7071067811865476)
v5 = aten.erf.default(v4)
v6 = aten.add.Tensor(v5, 1)
v7 = aten.mul.Tensor(v6, 0.5)
v8 = aten.mul.Tensor(in2, in2)
v9 = aten.mul.Tensor(v8, -0.5)
v10 = aten.exp.default(v9)
v11 = aten.mul.Tensor(v10, 0.3989422804014327)
v12 = aten.mul.Tensor(in2, v11)
v13 = aten.add.Tensor(v7, v12)
v14 = aten.mul.Tensor(v2, v13)
v15 = aten.sum.dim_IntList(v14, [0], True)
return (in0, in3, in4, v3, v14, v15)
""")
        self.assertExpectedInline(dw, """\
in0 = input()
in1 = input()
in2 = input()
in3 = input()
in4 = input()
in5 = input()
v0 = aten.permute.default(in2, [1, 0])
v1 = aten.mm.default(v0, in1)
v2 = aten.view.default(in3, [4])
v3 = aten.permute.default(in4, [1, 0])
v4 = aten.mm.default(v3, in0)
v5 = aten.view.default(in5, [8])
return (v4, v5, v1, v2)
""")
        self.assertExpectedInline(live, """\
primals_3 (input, tensor)
mul_2 (input, tensor)
tangents_1 (input, tensor)
sum_1 (dI, tensor)
mul_9 (dI, tensor)
sum_2 (dI, tensor)
bytes: 432 (all-crossing: 432)
""")

    def test_shared_weight(self) -> None:
        di, dw, live = split_of(SharedWeight(), torch.randn(2, 4, requires_grad=True))
        self.assertExpectedInline(di, """\
in0 = input()
in1 = input()
in2 = input()
in3 = input()
v0 = aten.permute.default(in0, [1, 0])
v1 = aten.permute.default(v0, [1, 0])
v2 = aten.mm.default(in3, v1)
v3 = aten.le.Scalar(in2, 0)
v4 = aten.full.default([], 0.0, dtype=torch.float32, layout=torch.strided, device=device(type='cpu'), pin_memory=False)
v5 = aten.where.self(v3, v4, v2)
v6 = aten.mm.default(v5, v1)
return (v6, in1, in2, in3, v5)
""")
        self.assertExpectedInline(dw, """\
in0 = input()
in1 = input()
in2 = input()
in3 = input()
v0 = aten.permute.default(in2, [1, 0])
v1 = aten.mm.default(v0, in1)
v2 = aten.permute.default(in3, [1, 0])
v3 = aten.mm.default(v2, in0)
v4 = aten.add.Tensor(v1, v3)
return (v4,)
""")
        self.assertExpectedInline(live, """\
primals_2 (input, tensor)
relu (input, tensor)
tangents_1 (input, tensor)
where (dI, tensor)
bytes: 128 (all-crossing: 128)
""")


if __name__ == "__main__":
    unittest.main()
