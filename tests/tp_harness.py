"""Multi-process harness for tensor parallelism inside split stages (CPU, gloo).

:func:`run_layer_case` runs in each of 2 ranks (a 1-D ``tp`` mesh) and
checks one tensor-parallel module compiled with fxsplit: the Llama-style
:class:`TPBlock` (``examples/tp_block.py``) (with or without sequence
parallelism), or a single layer kind (column-wise, row-wise, a
sequence-parallel norm + MLP). Spawned by
:func:`multirank.run_world` with it as the runner.

In-rank, for two microbatches split as a zero-bubble schedule does (B0, B1,
W1, W0), it compares against ordinary backward on identical copies (the same
module compiled with fxsplit, and uncompiled): the input gradients, and every
weight gradient as a DTensor (same placements, same local tensor; e.g. a
sequence-parallel norm weight's ``Partial`` gradient); and, through
``full_tensor()``, against a single-process unsharded module on the full
input. It returns what the parent checks: the collectives each phase ran
(profiler), the matmul FLOPs of each phase, and where the split placed the
collectives (dI or dW graph).

:func:`run_eager_split_case` is a comparison: a TP block compiled by
Inductor (``backend="inductor"``), split by fxsplit's eager split, which runs
the region's whole compiled backward once at B (``whole_nodes="once"``) or at
B and again at W (``"again"``, upstream's way).
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path
from typing import Any

# examples/tp_block.py: the Llama-style TP block and its plan, shared with examples/tp_pp_torchrun.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import torch
import torch.nn as nn

import zoo
from fxsplit.bench import world as W

TP = 2
DIM, HEADS, HIDDEN = 16, 4, 32
BATCH, SEQ = 2, 8  # one microbatch; SEQ is sharded over TP ranks under sequence parallelism
N_MICROBATCHES = 2
LAYER_KINDS = ("block", "colwise", "rowwise", "sp_mlp", "hf_llama", "gathered")


@dataclasses.dataclass(frozen=True)
class LayerCase:
    """One module on a 2-rank ``tp`` mesh. ``kind``: ``"block"`` (the TPBlock),
    ``"colwise"`` (one ColwiseParallel Linear), ``"rowwise"`` (one RowwiseParallel
    Linear), ``"sp_mlp"`` (RMSNorm + ColwiseParallel + RowwiseParallel with
    sequence parallelism), ``"hf_llama"`` (a model we did not write: a one-layer
    transformers ``LlamaModel``, random init, its decoder layer parallelized with
    torchtitan's plan and compiled; the final norm stays eager), ``"gathered"``
    (a weight sharded over the mesh and all-gathered inside the region, as
    SimpleFSDP does, its gradient reduce-scattered back: a collective only W
    needs; each rank takes its own share of the batch). ``sp``:
    sequence parallelism (block only; sp_mlp has
    it always). ``eager_below``: an eager, unsharded Linear runs before the
    compiled module (B then retains the graph for W's eager part)."""

    kind: str
    sp: bool = False
    compiler: str = "eager"
    defer: str | None = None
    eager_below: bool = False

    @property
    def name(self) -> str:
        extra = "".join((f"-{self.compiler}", f"-defer_{self.defer}" if self.defer else "",
                         "-eager_below" if self.eager_below else ""))
        return f"{self.kind}{'-sp' if self.sp or self.kind == 'sp_mlp' else ''}{extra}"

    @property
    def sequence_parallel(self) -> bool:
        return self.sp or self.kind == "sp_mlp"


class _SPMLP(nn.Module):
    """RMSNorm, then up (column-wise) -> GELU -> down (row-wise): the smallest sequence-parallel layer."""

    def __init__(self) -> None:
        super().__init__()
        from fxsplit.bench.models import RMSNorm

        self.norm = RMSNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class _GatheredLinear(nn.Module):
    """``x @ w.T`` with ``w`` a DTensor parameter sharded on dim 0, gathered for the
    matmul; its gradient, a partial sum on each rank, is reduce-scattered back to
    the shards (``to_local(grad_placements=[Partial()])``)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(DIM, DIM) / DIM**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Partial, Replicate

        w = self.weight
        if isinstance(w, DTensor):
            w = w.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
        return x @ w.t()


def _shard_weight(name: str, module: nn.Module, mesh: Any) -> None:
    """``distribute_module``'s partition function: every parameter sharded on dim 0."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for pname, p in list(module.named_parameters(recurse=False)):
        module.register_parameter(pname, nn.Parameter(distribute_tensor(p, mesh, [Shard(0)])))


class _WithEagerBelow(nn.Module):
    """An eager Linear, then the compiled module."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.pre = nn.Linear(DIM, DIM, bias=False)
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.pre(x))


def build(case: LayerCase) -> tuple[nn.Module, Any]:
    """The unsharded module (seeded) and its ``parallelize_module`` plan."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    from tp_block import TPBlock, block_plan

    torch.manual_seed(0)
    if case.kind == "block":
        module: nn.Module = TPBlock(DIM, HEADS, HIDDEN)
        plan = block_plan(case.sp)
    elif case.kind == "colwise":
        module, plan = zoo.Projection(DIM, HIDDEN), {"proj": ColwiseParallel()}
    elif case.kind == "rowwise":
        module, plan = zoo.Projection(HIDDEN, DIM), {"proj": RowwiseParallel()}
    elif case.kind == "hf_llama":
        module, plan = _HFLlama(), _hf_llama_plan()
    elif case.kind == "gathered":
        module, plan = _GatheredLinear(), None
    elif case.kind == "sp_mlp":
        module = _SPMLP()
        plan = {
            "norm": SequenceParallel(),
            "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1)),
        }
    else:
        raise ValueError(case.kind)
    with torch.no_grad():  # RMSNorm weights start at 1: make their gradients less special
        for p in module.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    if case.eager_below:
        module = _WithEagerBelow(module)
        plan = {f"inner.{k}": v for k, v in plan.items()}
    return module, plan


class _HFLlama(nn.Module):
    """transformers' ``LlamaModel`` (one layer, grouped-query attention) as a stage fed hidden states."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        config = transformers.LlamaConfig(
            hidden_size=DIM, num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=HEADS // 2,
            intermediate_size=HIDDEN, vocab_size=40, max_position_embeddings=64, bos_token_id=0,
            eos_token_id=0, pad_token_id=0,
        )
        self.model = transformers.LlamaModel(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(inputs_embeds=x).last_hidden_state


def _hf_llama_plan() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    layer = "model.layers.0."
    return {
        **{f"{layer}self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")},
        f"{layer}self_attn.o_proj": RowwiseParallel(),
        **{f"{layer}mlp.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj")},
        f"{layer}mlp.down_proj": RowwiseParallel(),
    }


def inner_of(module: nn.Module) -> nn.Module:
    """What the case compiles (in place)."""
    if isinstance(module, _HFLlama):
        return module.model.layers[0]
    return module.inner if isinstance(module, _WithEagerBelow) else module


def data(case: LayerCase, rank: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per microbatch: the full input and output gradient, and this rank's share of each."""
    g = torch.Generator().manual_seed(100)
    d_in = HIDDEN if case.kind == "rowwise" else DIM
    d_out = HIDDEN if case.kind == "colwise" else DIM
    result = []
    for _ in range(N_MICROBATCHES):
        x = torch.randn(BATCH, SEQ, d_in, generator=g)
        dy = torch.randn(BATCH, SEQ, d_out, generator=g)
        if case.sequence_parallel:
            xl, dyl = x.chunk(TP, dim=1)[rank], dy.chunk(TP, dim=1)[rank]
        elif case.kind == "colwise":
            xl, dyl = x, dy.chunk(TP, dim=-1)[rank]  # output sharded on the last dim
        elif case.kind == "rowwise":
            xl, dyl = x.chunk(TP, dim=-1)[rank], dy  # input sharded on the last dim
        elif case.kind == "gathered":
            xl, dyl = x.chunk(TP, dim=0)[rank], dy.chunk(TP, dim=0)[rank]  # each rank its share of the batch
        else:
            xl, dyl = x, dy
        result.append((x, dy, xl.contiguous(), dyl.contiguous()))
    return result


def local_share(case: LayerCase, full_dx: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's share of the full input gradient (what its input's gradient holds)."""
    if case.sequence_parallel:
        return full_dx.chunk(TP, dim=1)[rank]
    if case.kind == "rowwise":
        return full_dx.chunk(TP, dim=-1)[rank]
    if case.kind == "gathered":
        return full_dx.chunk(TP, dim=0)[rank]
    return full_dx


# ---------------------------------------------------------------------------------------------
class Phase:
    """Runs ``fn`` under the profiler and (``flops=True``) the matmul FLOP counter;
    keeps what they saw (``flops`` is ``None`` when not counted). The counter is a
    dispatch mode: it sees compiled graphs' ops at their local shapes, but eager
    DTensor code under it fails (a redistribute's backward gets a plain tensor)."""

    def __init__(self, fn: Any, flops: bool = True) -> None:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            if flops:
                with W.MatmulCounter() as counter:
                    fn()
            else:
                fn()
        self.collectives = W.collective_counts(W.collectives(prof))
        self.flops = counter.total if flops else None


def graph_collectives(gm: torch.fx.GraphModule) -> list[str]:
    """The functional collectives (issue ops, not waits) a graph runs, by op name, in order."""
    return [
        n.target._schema.name.split("::")[-1]
        for n in gm.graph.nodes
        if n.op == "call_function" and str(getattr(n.target, "namespace", "")) == "_c10d_functional"
        and "wait" not in n.target._schema.name
    ]


def waits_without_their_collective(gm: torch.fx.GraphModule) -> list[str]:
    """``wait_tensor`` nodes of ``gm`` whose collective was issued in another graph
    (their input is a placeholder: the un-waited tensor crossed)."""
    return [
        n.name for n in gm.graph.nodes
        if n.op == "call_function" and n.target is torch.ops._c10d_functional.wait_tensor.default
        and n.args[0].op == "placeholder"
    ]


def weight_grad_flops(module: nn.Module, tokens: int) -> int:
    """FLOPs of every Linear's weight-gradient matmul at this rank's local shapes
    (``2 * tokens * local numel``: each rank's Linear sees every token of the microbatch;
    a gathered weight's matmul is at its full shape, on this rank's tokens)."""
    if isinstance(module, _GatheredLinear):
        return 2 * (tokens // TP) * DIM * DIM
    total = 0
    for m in module.modules():
        if isinstance(m, nn.Linear):
            w = m.weight
            local = w.to_local() if hasattr(w, "to_local") else w
            total += 2 * tokens * local.numel()
    return total


def _assert_same_grad(got: torch.Tensor | None, want: torch.Tensor | None, what: str) -> None:
    from torch.distributed.tensor import DTensor

    assert (got is None) == (want is None), f"{what}: one gradient is None ({got is None}, {want is None})"
    if got is None:
        return
    assert type(got) is type(want), f"{what}: {type(got).__name__} vs {type(want).__name__}"
    if isinstance(want, DTensor):
        assert got.placements == want.placements, f"{what}: placements {got.placements} vs {want.placements}"
        assert got.shape == want.shape and got.stride() == want.stride(), f"{what}: shape or stride differ"
        got, want = got.to_local(), want.to_local()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def run_layer_case(case: LayerCase, rank: int, world: int) -> dict[str, Any]:
    """One module on the ``tp`` mesh (module docstring); returns per-phase counts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    import fxsplit

    assert world == TP
    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    reference, plan = build(case)
    options = {"compiler": case.compiler, "fallback": "error"}
    if case.defer:
        options["defer"] = case.defer
    # One backend for both compiled copies: Dynamo compiles the region once and both
    # copies call it (ordinary backward through it runs its fused graph).
    backend = fxsplit.backend(**options)
    copies = {}
    for name in ("split", "ordinary", "uncompiled"):
        m = copy.deepcopy(reference)
        if plan is None:
            from torch.distributed.tensor import distribute_module

            distribute_module(m, mesh, _shard_weight)
        else:
            parallelize_module(m, mesh, plan)
        if name != "uncompiled":
            inner_of(m).compile(backend=backend)
        copies[name] = m
    before = set(map(id, fxsplit.compiled_regions()))
    batches = data(case, rank)

    # single-process reference on the full tensors
    ref_dx = []
    for x, dy, _, _ in batches:
        x = x.clone().requires_grad_()
        reference(x).backward(dy)
        ref_dx.append(x.grad)

    # ordinary backward on the identical copies, one microbatch at a time
    ordinary: dict[str, list[Phase]] = {}
    ordinary_dx: dict[str, list[torch.Tensor]] = {}
    for name in ("ordinary", "uncompiled"):
        ordinary[name], ordinary_dx[name] = [], []
        for _, _, xl, dyl in batches:
            xl = xl.clone().requires_grad_()
            out = copies[name](xl)
            ordinary[name].append(Phase(lambda out=out, dyl=dyl: out.backward(dyl)))
            ordinary_dx[name].append(xl.grad)

    # the split: B0, B1, then W1, W0 (a zero-bubble order)
    m = copies["split"]
    params = list(m.parameters())
    inputs, outs = [], []
    for _, _, xl, _ in batches:
        inputs.append(xl.clone().requires_grad_())
        outs.append(m(inputs[-1]))
    b_phases, w_phases, works, dxs = [], [], [], []
    for k, (_, _, _, dyl) in enumerate(batches):
        result: dict[str, Any] = {}

        def b(k: int = k, dyl: torch.Tensor = dyl, result: dict[str, Any] = result) -> None:
            result["dx"], result["work"] = fxsplit.stage_backward_input([outs[k]], [dyl], [inputs[k]], params)

        b_phases.append(Phase(b))
        assert all(p.grad is None for p in params), f"{case.name}: B changed a weight's .grad"
        works.append(result["work"])
        dxs.append(result["dx"][0])
    for k in reversed(range(N_MICROBATCHES)):
        w_phases.insert(0, Phase(lambda k=k: fxsplit.stage_backward_weight(params, works[k])))

    # gradients: input gradients per microbatch, weights accumulated over both
    where = f"{case.name} rank {rank}"
    for k in range(N_MICROBATCHES):
        for name in ("ordinary", "uncompiled"):
            torch.testing.assert_close(
                dxs[k], ordinary_dx[name][k], rtol=1e-5, atol=1e-6,
                msg=lambda msg, k=k, name=name: f"{where}: dx of microbatch {k} vs {name}: {msg}")
        torch.testing.assert_close(dxs[k], local_share(case, ref_dx[k], rank), rtol=1e-4, atol=1e-5,
                                   msg=lambda msg, k=k: f"{where}: dx of microbatch {k} vs unsharded: {msg}")
    placements = {}
    named = {name: dict(c.named_parameters()) for name, c in copies.items()}
    for pname, p in m.named_parameters():
        for name in ("ordinary", "uncompiled"):
            _assert_same_grad(p.grad, named[name][pname].grad, f"{where}: {pname}.grad vs {name} backward")
        full = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        if full is None and reference.get_parameter(pname).grad is None:
            continue  # unused (transformers' embedding, fed inputs_embeds)
        torch.testing.assert_close(full, reference.get_parameter(pname).grad, rtol=1e-4, atol=1e-5,
                                   msg=lambda msg, pname=pname: f"{where}: {pname}.grad vs unsharded: {msg}")
        placements[pname] = [repr(pl) for pl in p.grad.placements] if isinstance(p.grad, DTensor) else None

    regions = [r for r in fxsplit.compiled_regions() if id(r) not in before and r.stats["di_runs"]]
    assert len(regions) == 1, f"{where}: expected one split region, got {len(regions)}"
    split = regions[0].split
    tokens = BATCH * SEQ
    names = [n for n, _ in m.named_parameters()]
    in_graph = sorted({names[k] for work in works for k in work.accumulated_in_graph})
    return {
        "case": case.name,
        "rank": rank,
        "placements": placements,
        "b": [(p.collectives, p.flops) for p in b_phases],
        "w": [(p.collectives, p.flops) for p in w_phases],
        "ordinary": [(p.collectives, p.flops) for p in ordinary["ordinary"]],
        "uncompiled": [(p.collectives, p.flops) for p in ordinary["uncompiled"]],
        "di_collectives": graph_collectives(split.di_graph),
        "dw_collectives": graph_collectives(split.dw_graph),
        "split_waits": [*waits_without_their_collective(split.di_graph),
                        *waits_without_their_collective(split.dw_graph)],
        "fused_collectives": graph_collectives(_fused_graph(regions[0])),
        "live_ins": [str(li) for li in split.live_ins],
        "gathered_output_grad_crosses": gathered_output_grad_crosses(split),
        "accumulated_in_graph": in_graph,
        "weight_grad_flops": weight_grad_flops(inner_of(m), tokens),
        "eager_weight_flops": (2 * tokens * DIM * DIM) if case.eager_below else 0,
        "stats": dict(regions[0].stats),
    }


def gathered_output_grad_crosses(split: Any) -> bool:
    """Whether a live-in computed by dI is the all-gathered output gradient (a
    view of what an ``all_gather_into_tensor`` of a tangent returns, waited in dI)."""
    nodes = {n.name: n for n in split.di_graph.graph.nodes}
    for live in split.live_ins:
        if live.source != "dI":
            continue
        stack, seen = [nodes[live.name]], set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n.op == "call_function" and "all_gather_into_tensor" in str(n.target):
                if any(a.op == "placeholder" and a.name.startswith("tangents") for a in n.all_input_nodes):
                    return True
                continue
            if n.op == "call_function" and n.target is not torch.ops.aten.mm.default:
                stack.extend(n.all_input_nodes)
    return False


def _fused_graph(region: Any) -> torch.fx.GraphModule:
    """The region's whole backward graph (what its fused backward runs)."""
    return region.graphs._bw


# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class EagerSplitCase:
    """The TP block compiled by ``backend=...`` (not fxsplit), split by fxsplit's eager split
    with ``fxsplit.config.whole_nodes`` = ``whole_nodes`` (``"again"``: the way upstream
    splits compiled stages, the region's backward at B and again at W)."""

    sp: bool = True
    backend: str = "inductor"
    whole_nodes: str = "again"

    @property
    def name(self) -> str:
        return f"eager-split-{self.backend}{'-sp' if self.sp else ''}-{self.whole_nodes}"


def run_eager_split_case(case: EagerSplitCase, rank: int, world: int) -> dict[str, Any]:
    """B and W of one microbatch through fxsplit's API on a stage compiled by
    ``case.backend``, and ordinary backward of the same stage, counted per phase."""
    import torch._functorch.config as functorch_config
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    import fxsplit

    assert world == TP
    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    layer = LayerCase("block", sp=case.sp)
    reference, plan = build(layer)
    (x, dy, xl, dyl), = data(layer, rank)[:1]
    # "again": W re-runs the region's backward from what B saved (retain_graph): AOTAutograd's
    # donated buffers forbid that, as with upstream's split.
    with functorch_config.patch(donated_buffer=False), fxsplit.config.patch(whole_nodes=case.whole_nodes):
        copies = {}
        for name in ("split", "ordinary"):
            m = copy.deepcopy(reference)
            parallelize_module(m, mesh, plan)
            m.compile(backend=case.backend)
            copies[name] = m
        xo = xl.clone().requires_grad_()
        out = copies["ordinary"](xo)
        ordinary = Phase(lambda: out.backward(dyl))
        m = copies["split"]
        params = list(m.parameters())
        xs = xl.clone().requires_grad_()
        out = m(xs)
        result: dict[str, Any] = {}

        def b() -> None:
            result["dx"], result["work"] = fxsplit.stage_backward_input([out], [dyl], [xs], params)

        b_phase = Phase(b)
        w_phase = Phase(lambda: fxsplit.stage_backward_weight(params, result["work"]))
    where = f"{case.name} rank {rank}"
    torch.testing.assert_close(result["dx"][0], xo.grad, msg=lambda msg: f"{where}: dx: {msg}")
    ordinary_params = dict(copies["ordinary"].named_parameters())
    for pname, p in m.named_parameters():
        _assert_same_grad(p.grad, ordinary_params[pname].grad, f"{where}: {pname}.grad")
        assert isinstance(p.grad, DTensor)
    return {
        "case": case.name,
        "rank": rank,
        "b": (b_phase.collectives, b_phase.flops),
        "w": (w_phase.collectives, w_phase.flops),
        "ordinary": (ordinary.collectives, ordinary.flops),
    }


def run_tp_case(case: Any, rank: int, world: int) -> dict[str, Any]:
    """Dispatch on the case's type (one world runs both kinds)."""
    if isinstance(case, EagerSplitCase):
        return run_eager_split_case(case, rank, world)
    return run_layer_case(case, rank, world)
