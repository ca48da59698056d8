"""Golden graphs: the dI graph, the dW graph and the live-ins for a few canonical blocks.

Each block is compiled with ``fxsplit.backend(compiler="eager")``; the split
of its backward graph is read from ``fxsplit.compiled_regions()[-1].split`` and
compared, as ``fxsplit.passes.normalized_graph_code`` text, with the strings inline
below (``expecttest.TestCase.assertExpectedInline``).

The goldens are tied to the torch release CI pins (torch==2.13.0): AOTAutograd's
decompositions and partitioner decide the exact ops, so other releases produce
other (equally correct) graphs, and these tests are skipped there. After an
intended change (or a torch bump), refresh them in place with::

    EXPECTTEST_ACCEPT=1 python -m pytest tests/test_golden.py

and review the diff of this file.
"""

from __future__ import annotations

import unittest

import expecttest
import torch
import torch._dynamo
import torch.nn as nn

import fxsplit
import zoo
from fxsplit.passes import normalized_graph_code

GOLDEN_TORCH = "2.13.0"


def split_of(module: nn.Module, *inputs: torch.Tensor, dynamic: bool | None = None) -> tuple[str, str, str]:
    """(dI code, dW code, live-ins) of the backward of ``module`` compiled on ``inputs``."""
    torch._dynamo.reset()
    before = fxsplit.compiled_regions()
    cm = torch.compile(module, backend=fxsplit.backend(compiler="eager", fallback="error"), dynamic=dynamic)
    cm(*inputs)
    regions = [r for r in fxsplit.compiled_regions() if not any(r is b for b in before)]
    assert len(regions) == 1, f"expected one compiled region, got {len(regions)}"
    split = regions[0].split
    live = "\n".join(str(l) for l in split.live_ins) + "\n"
    return normalized_graph_code(split.di_graph), normalized_graph_code(split.dw_graph), live


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
        di, dw, live = split_of(nn.Linear(4, 3), torch.randn(2, 4, requires_grad=True))
        self.assertExpectedInline(di, """\
in0 = input()
in1 = input()
in2 = input()
v0 = aten.permute.default(in0, [1, 0])
v1 = aten.permute.default(v0, [1, 0])
v2 = aten.mm.default(in2, v1)
return (v2, in1, in2)
""")
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
""")

    def test_mlp(self) -> None:
        di, dw, live = split_of(zoo.MLP(4, 8), torch.randn(2, 4, requires_grad=True))
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
v3 = aten.mul.Tensor(in3, 0.7071067811865476)
v4 = aten.erf.default(v3)
v5 = aten.add.Tensor(v4, 1)
v6 = aten.mul.Tensor(v5, 0.5)
v7 = aten.mul.Tensor(in3, in3)
v8 = aten.mul.Tensor(v7, -0.5)
v9 = aten.exp.default(v8)
v10 = aten.mul.Tensor(v9, 0.3989422804014327)
v11 = aten.mul.Tensor(in3, v10)
v12 = aten.add.Tensor(v6, v11)
v13 = aten.mul.Tensor(v2, v12)
v14 = aten.permute.default(in0, [1, 0])
v15 = aten.permute.default(v14, [1, 0])
v16 = aten.mm.default(v13, v15)
return (v16, in1, in4, in5, v13)
""")
        self.assertExpectedInline(dw, """\
in0 = input()
in1 = input()
in2 = input()
in3 = input()
v0 = aten.permute.default(in2, [1, 0])
v1 = aten.mm.default(v0, in1)
v2 = aten.sum.dim_IntList(in2, [0], True)
v3 = aten.view.default(v2, [4])
v4 = aten.permute.default(in3, [1, 0])
v5 = aten.mm.default(v4, in0)
v6 = aten.sum.dim_IntList(in3, [0], True)
v7 = aten.view.default(v6, [8])
return (v5, v7, v1, v3)
""")
        self.assertExpectedInline(live, """\
primals_3 (input, tensor)
mul_2 (input, tensor)
tangents_1 (input, tensor)
mul_9 (dI, tensor)
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
v0 = aten.permute.default(in4, [1, 0])
v1 = aten.mm.default(v0, in3)
v2 = aten.sum.dim_IntList(in4, [0], True)
v3 = aten.view.default(v2, [4])
v4 = aten.permute.default(in5, [1, 0])
v5 = aten.mm.default(v4, in2)
v6 = aten.sum.dim_IntList(in5, [0], True)
v7 = aten.view.default(v6, [8])
return (v5, v7, v1, v3)
""")
        self.assertExpectedInline(live, """\
primals_3 (input, symint)
primals_4 (input, symint)
view (input, tensor)
view_2 (input, tensor)
view_4 (dI, tensor)
view_7 (dI, tensor)
""")

    def test_layernorm_linear(self) -> None:
        di, dw, live = split_of(zoo.LayerNormLinear(4), torch.randn(2, 4, requires_grad=True))
        self.assertExpectedInline(di, """\
in0 = input()
in1 = input()
in2 = input()
in3 = input()
in4 = input()
v0 = aten.permute.default(in2, [1, 0])
v1 = aten.permute.default(v0, [1, 0])
v2 = aten.mm.default(in4, v1)
v3 = aten.mul.Tensor(v2, in0)
v4 = aten.mul.Tensor(v3, 4)
v5 = aten.sum.dim_IntList(v3, [1], True)
v6 = aten.var_mean.correction(in1, [1], correction=0, keepdim=True)
v7 = getitem(v6, 0)
v8 = getitem(v6, 1)
v9 = aten.add.Tensor(v7, 1e-05)
v10 = aten.rsqrt.default(v9)
v11 = aten.sub.Tensor(in1, v8)
v12 = aten.mul.Tensor(v11, v10)
v13 = aten.mul.Tensor(v3, v12)
v14 = aten.sum.dim_IntList(v13, [1], True)
v15 = aten.mul.Tensor(v12, v14)
v16 = aten.sub.Tensor(v4, v5)
v17 = aten.sub.Tensor(v16, v15)
v18 = aten.div.Tensor(v10, 4)
v19 = aten.mul.Tensor(v18, v17)
return (v19, in3, in4, v2, v12)
""")
        self.assertExpectedInline(dw, """\
in0 = input()
in1 = input()
in2 = input()
in3 = input()
v0 = aten.permute.default(in1, [1, 0])
v1 = aten.mm.default(v0, in0)
v2 = aten.sum.dim_IntList(in1, [0], True)
v3 = aten.view.default(v2, [4])
v4 = aten.mul.Tensor(in2, in3)
v5 = aten.sum.dim_IntList(v4, [0])
v6 = aten.sum.dim_IntList(in2, [0])
return (v5, v6, v1, v3)
""")
        self.assertExpectedInline(live, """\
add_1 (input, tensor)
tangents_1 (input, tensor)
mm (dI, tensor)
mul (dI, tensor)
""")

    def test_first_stage_input_without_grad(self) -> None:
        di, dw, live = split_of(zoo.MLP(4, 8), torch.randn(2, 4))
        self.assertExpectedInline(di, """\
in0 = input()
in1 = input()
in2 = input()
in3 = input()
in4 = input()
return (in0, in1, in2, in3, in4)
""")
        self.assertExpectedInline(dw, """\
in0 = input()
in1 = input()
in2 = input()
in3 = input()
in4 = input()
v0 = aten.permute.default(in1, [1, 0])
v1 = aten.permute.default(v0, [1, 0])
v2 = aten.mm.default(in4, v1)
v3 = aten.permute.default(in4, [1, 0])
v4 = aten.mm.default(v3, in3)
v5 = aten.sum.dim_IntList(in4, [0], True)
v6 = aten.view.default(v5, [4])
v7 = aten.mul.Tensor(in2, 0.7071067811865476)
v8 = aten.erf.default(v7)
v9 = aten.add.Tensor(v8, 1)
v10 = aten.mul.Tensor(v9, 0.5)
v11 = aten.mul.Tensor(in2, in2)
v12 = aten.mul.Tensor(v11, -0.5)
v13 = aten.exp.default(v12)
v14 = aten.mul.Tensor(v13, 0.3989422804014327)
v15 = aten.mul.Tensor(in2, v14)
v16 = aten.add.Tensor(v10, v15)
v17 = aten.mul.Tensor(v2, v16)
v18 = aten.permute.default(v17, [1, 0])
v19 = aten.mm.default(v18, in0)
v20 = aten.sum.dim_IntList(v17, [0], True)
v21 = aten.view.default(v20, [8])
return (v19, v21, v4, v6)
""")
        self.assertExpectedInline(live, """\
primals_3 (input, tensor)
primals_4 (input, tensor)
addmm (input, tensor)
mul_2 (input, tensor)
tangents_1 (input, tensor)
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
""")


if __name__ == "__main__":
    unittest.main()
