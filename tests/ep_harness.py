"""Expert parallelism (EP) inside fxsplit pipeline stages: pp x ep on CPU with gloo.

The ranks form a ``(pp, ep)`` mesh of 2 x 2. Four pipeline stages, two per
pipeline rank (V placement for ``ScheduleZBVZeroBubble`` and
``ScheduleDualPipeV``, looped for ``ScheduleInterleavedZeroBubble``), each one
mixture-of-experts block (:class:`MoEStage`): a dense projection, a softmax
router choosing the top 2 of 4 SwiGLU-free experts, and experts sharded over
``ep`` (2 per rank). Tokens reach their experts as torchtitan's all-to-all
token dispatcher sends them: each rank counts its tokens per expert, the
counts go through one all-to-all (``.tolist()`` of the split sizes is a graph
break), the tokens through ``all_to_all_single_autograd`` with those variable
split sizes, the experts run on what they received (a loop over local
experts, or ``torch._grouped_mm`` in bfloat16), and a second all-to-all
brings the results back. Every stage module is compiled in place with fxsplit
(several regions per stage, between the graph breaks) and driven by an
upstream schedule over fxsplit ``PipelineStage`` s for two steps.

Each ep rank is a data replica for the dense weights (they are not reduced
here: each rank's router and projection get the gradient of its own tokens)
and the owner of its experts (whose gradients come from both ranks' tokens).
The single-process reference holds all experts, and one copy of the dense
weights per ep rank, runs both ranks' data, and sums both ranks' losses.
Routings differ per microbatch, and one microbatch of ep rank 1 is built so
that no token picks expert 3 (rank 1's second expert gets none).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import dp_harness as dh
import pipeline_harness as ph

PP, EP = 2, 2
WORLD = PP * EP
N_STAGES = 4
DIM, HIDDEN = 16, 32
N_EXPERTS, TOP_K = 4, 2
LOCAL = N_EXPERTS // EP
MB_BATCH, SEQ = 2, 8
N_MICROBATCHES = 4
N_STEPS = 2
LR = 0.05
STARVED = 3  # the expert no token of STARVED_MB (on ep rank 1) picks
STARVED_MB = 1


@dataclasses.dataclass(frozen=True)
class EPCase:
    """``schedule``; ``experts``: ``"loop"`` (one matmul pair per local expert) or
    ``"grouped_mm"`` (``torch._grouped_mm``, bfloat16); ``compiler``: fxsplit's."""

    schedule: str
    experts: str = "loop"
    compiler: str = "eager"

    @property
    def name(self) -> str:
        return f"{self.schedule}-{self.experts}-{self.compiler}"


def _act(h: torch.Tensor) -> torch.Tensor:
    return F.gelu(h)


class MoEStage(nn.Module):
    """x + experts(route(proj(x))): the experts at ``expert_ids`` live here.

    ``group`` is the ep process group (``None``: every expert is local, no
    communication: the reference). ``experts``: ``"loop"`` or ``"grouped_mm"``.
    """

    def __init__(self, expert_ids: list[int], experts: str, group: Any = None) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.router = nn.Linear(DIM, N_EXPERTS, bias=False)
        self.expert_ids = list(expert_ids)
        self.mode = experts
        self.group = group
        dtype = torch.bfloat16 if experts == "grouped_mm" else torch.float32
        self.w_in = nn.Parameter(torch.randn(len(expert_ids), DIM, HIDDEN, dtype=dtype) * DIM**-0.5)
        self.w_out = nn.Parameter(torch.randn(len(expert_ids), HIDDEN, DIM, dtype=dtype) * HIDDEN**-0.5)

    def _experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each local expert on its rows (``rows`` sorted by local expert, ``counts[e]`` rows each)."""
        if self.mode == "grouped_mm":
            offs = torch.cumsum(counts, 0).to(torch.int32)
            h = torch._grouped_mm(rows.to(torch.bfloat16), self.w_in, offs=offs)
            return torch._grouped_mm(_act(h), self.w_out, offs=offs).to(rows.dtype)
        parts = rows.split(counts.tolist())  # a graph break, as in torchtitan's loop over experts
        return torch.cat([_act(part @ self.w_in[e]) @ self.w_out[e] for e, part in enumerate(parts)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.proj(x).reshape(b * t, d)
        probs = self.router(h).softmax(-1)
        weights, chosen = probs.topk(TOP_K, dim=-1)
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)
        rows = h[order // TOP_K]
        counts = torch.bincount(flat, minlength=N_EXPERTS)
        if self.group is None:  # every expert here (the reference)
            out_rows = self._experts(rows, counts)
        else:
            out_rows = self._dispatch_and_run(rows, counts)
        combined = torch.zeros_like(h).index_add(0, order // TOP_K, out_rows * weights.reshape(-1)[order].unsqueeze(1))
        return x + combined.reshape(b, t, d)

    def _dispatch_and_run(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """torchtitan's all-to-all token dispatch: the counts, then the tokens, to
        the ranks owning the experts (split sizes from ``.tolist()``, a graph
        break); the experts on the rows regrouped by expert; the results back."""
        from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd

        group = self.group
        ep, local = N_EXPERTS // len(self.expert_ids), len(self.expert_ids)
        received = all_to_all_single(counts, None, None, group)  # [src rank][my expert] counts
        send = counts.view(ep, local).sum(1).tolist()
        recv = received.view(ep, local).sum(1).tolist()
        got = all_to_all_single_autograd(rows, recv, send, group)
        # rows arrive grouped by source rank, then by expert: regroup them by expert
        expert_of_row = torch.arange(local, device=rows.device).repeat(ep).repeat_interleave(
            received, output_size=got.shape[0])
        perm = expert_of_row.argsort(stable=True)
        out = self._experts(got[perm], received.view(ep, local).sum(0))
        back = torch.empty_like(out).index_copy(0, perm, out)
        return all_to_all_single_autograd(back, send, recv, group)


def build_reference(experts: str) -> list[list[MoEStage]]:
    """``[ep rank][stage]``: every stage with all experts; ep rank 1's copy has
    ep rank 0's dense weights and shares its experts (one set of them)."""
    torch.manual_seed(0)
    ranks: list[list[MoEStage]] = [[], []]
    for _ in range(N_STAGES):
        m = MoEStage(list(range(N_EXPERTS)), experts)
        twin = copy.deepcopy(m)
        twin.w_in, twin.w_out = m.w_in, m.w_out
        ranks[0].append(m)
        ranks[1].append(twin)
    return ranks


def local_stage(ref: MoEStage, ep_rank: int, experts: str, group: Any) -> MoEStage:
    ids = list(range(ep_rank * LOCAL, (ep_rank + 1) * LOCAL))
    m = MoEStage(ids, experts, group)
    with torch.no_grad():
        m.proj.load_state_dict(ref.proj.state_dict())
        m.router.load_state_dict(ref.router.state_dict())
        m.w_in.copy_(ref.w_in[ids[0]:ids[-1] + 1])
        m.w_out.copy_(ref.w_out[ids[0]:ids[-1] + 1])
    return m


def make_data(step: int, ep_rank: int, first: MoEStage) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's batch for a step (random: routings differ per microbatch). On ep
    rank 1, microbatch STARVED_MB lies along the direction that gives expert
    STARVED the lowest router logit in the first stage (``first``, the
    reference's stage 0 as it is at this step), so no token there picks it."""
    g = torch.Generator().manual_seed(1000 * step + ep_rank)
    x = torch.randn(N_MICROBATCHES * MB_BATCH, SEQ, DIM, generator=g)
    y = torch.randn(N_MICROBATCHES * MB_BATCH, SEQ, DIM, generator=g)
    if ep_rank == 1:
        with torch.no_grad():
            direction = -(first.router.weight[STARVED] @ first.proj.weight)
            direction = direction / direction.norm()
            rows = slice(STARVED_MB * MB_BATCH, (STARVED_MB + 1) * MB_BATCH)
            x[rows] = 20.0 * direction + 0.1 * x[rows]
    return x, y


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def first_stage_counts(first: MoEStage, x: torch.Tensor) -> list[list[int]]:
    """Tokens per expert in the first stage, per microbatch of ``x``."""
    with torch.no_grad():
        out = []
        for mb in x.chunk(N_MICROBATCHES):
            h = first.proj(mb).reshape(-1, DIM)
            chosen = first.router(h).softmax(-1).topk(TOP_K, dim=-1).indices.reshape(-1)
            out.append(torch.bincount(chosen, minlength=N_EXPERTS).tolist())
        return out


def run_ep_case(case: EPCase, rank: int, world: int) -> dict[str, Any]:
    """One case in one rank (module docstring): losses and gradients against the
    reference, and per action the collectives, the region counters and the expert
    weight-gradient matmuls."""
    import torch.distributed.pipelining.schedules as schedules
    from torch.distributed.device_mesh import init_device_mesh

    import fxsplit

    assert world == WORLD
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # graph breaks of this case only
    mesh = init_device_mesh("cpu", (PP, EP), mesh_dim_names=("pp", "ep"))
    pp_rank, ep_rank = mesh["pp"].get_local_rank(), mesh["ep"].get_local_rank()
    stage_ids, n_stages = ph.stage_ids_for(case.schedule, pp_rank, PP)
    assert n_stages == N_STAGES
    reference = build_reference(case.experts)
    backend = fxsplit.backend(compiler=case.compiler, fallback="error")
    modules: dict[int, MoEStage] = {}
    before = fxsplit.compiled_regions()
    for s in stage_ids:
        m = local_stage(reference[ep_rank][s], ep_rank, case.experts, mesh["ep"].get_group())
        m.compile(backend=backend)  # in place: the stage's regions, between the graph breaks
        modules[s] = m
    stage_cls = _ExpertStage.make()
    stages = [stage_cls(modules[s], s, n_stages, torch.device("cpu"), group=mesh["pp"].get_group()) for s in stage_ids]
    schedule = getattr(schedules, case.schedule)(stages, N_MICROBATCHES, loss_fn=loss_fn)
    ref_params = [p for r in reference for m in r for p in m.parameters()]
    ref_opt = torch.optim.SGD(list({id(p): p for p in ref_params}.values()), lr=LR)
    opt = torch.optim.SGD([p for m in modules.values() for p in m.parameters()], lr=LR)
    has_first, has_last = 0 in stage_ids, n_stages - 1 in stage_ids
    step_losses: list[list[float]] = []
    grads_checked = 0
    collectives: list[tuple[str, str]] = []
    routings: list[list[list[int]]] = []
    for step in range(N_STEPS):
        data = [make_data(step, r, reference[0][0]) for r in range(EP)]
        routings.append(first_stage_counts(reference[1][0], data[1][0]))
        # reference: every rank's data through its copy of the dense weights and the shared experts
        ref_losses: list[list[torch.Tensor]] = []
        total: Any = 0
        for r in range(EP):
            x, y = data[r]
            h = x
            for m in reference[r]:
                h = m(h)
            losses_r = [loss_fn(o, t) for o, t in zip(h.chunk(N_MICROBATCHES), y.chunk(N_MICROBATCHES))]
            ref_losses.append(losses_r)
            total = total + torch.stack(losses_r).mean()
        total.backward()
        for st in stages:
            st.actions.clear()
        losses: list[torch.Tensor] = []
        x, y = data[ep_rank]
        args = (x,) if has_first else ()
        kwargs: dict[str, Any] = {"target": y, "losses": losses} if has_last else {}
        collectives = dh.step_collecting(schedule, step == N_STEPS - 1, *args, **kwargs) or []
        where = f"{case.name} rank {rank} (pp {pp_rank}, ep {ep_rank}) step {step}"
        if has_last:
            got = [float(v.detach()) for v in losses]
            want = [float(v.detach()) for v in ref_losses[ep_rank]]
            tol = dict(rtol=2e-2, atol=2e-3) if case.experts == "grouped_mm" else dict(rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **tol,
                                       msg=lambda m: f"{where}: microbatch losses differ: {m}")
            step_losses.append(got)
        for s, m in modules.items():
            ref = reference[ep_rank][s]
            lo, hi = m.expert_ids[0], m.expert_ids[-1] + 1
            for name, p, want_grad in (
                ("proj.weight", m.proj.weight, ref.proj.weight.grad),
                ("proj.bias", m.proj.bias, ref.proj.bias.grad),
                ("router.weight", m.router.weight, ref.router.weight.grad),
                ("w_in", m.w_in, ref.w_in.grad[lo:hi]),
                ("w_out", m.w_out, ref.w_out.grad[lo:hi]),
            ):
                _check_grad(where, s, name, p.grad, want_grad, case)
                grads_checked += 1
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    actions = [a for st in stages for a in st.actions]
    dh.label_actions(actions, collectives)
    regions = [r for r in fxsplit.compiled_regions() if not any(r is b for b in before)]
    return {
        "case": case.name,
        "rank": rank,
        "pp_rank": pp_rank,
        "ep_rank": ep_rank,
        "stages": stage_ids,
        "losses": step_losses,
        "grads_checked": grads_checked,
        "actions": actions,  # last step
        "regions": len(regions),
        "fallbacks": [str(f) for f in fxsplit.fallbacks()],
        "graph_breaks": int(sum(torch._dynamo.utils.counters["graph_break"].values())),
        "first_stage_routing_ep1": routings,  # tokens per expert, per microbatch, per step
        "describe": [r.split.describe().splitlines()[0] for r in regions],
    }


def _check_grad(where: str, s: int, name: str, got: torch.Tensor | None, want: torch.Tensor | None,
                case: EPCase) -> None:
    assert got is not None and want is not None, f"{where}: stage {s} {name}: no gradient"
    if case.experts == "grouped_mm" and name.startswith("w_"):
        tol = dict(rtol=3e-2, atol=3e-3)  # bf16 experts
    elif case.experts == "grouped_mm":
        tol = dict(rtol=2e-2, atol=2e-3)  # downstream of bf16 experts
    else:
        tol = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.float(), want.float(), **tol,
                               msg=lambda m: f"{where}: stage {s} {name}.grad: {m}")


class _ExpertStage:
    """dp_harness's stage (region counters and collectives per action), which also
    counts the expert weight-gradient matmuls each backward action dispatches."""

    @staticmethod
    def make() -> type:
        base = dh.make_dp_stage_class()

        class ExpertStage(base):  # type: ignore[misc, valid-type]
            def _record(self, kind: str, mb: int, fn: Any) -> None:
                runs = ph.RegionRuns()
                with _ExpertMatmuls(self.submod) as ledger:
                    fn()
                rec = runs.delta()
                rec.update(stage=self.stage_index, kind=kind, mb=mb, expert_weight_matmuls=ledger.count)
                self.actions.append(rec)

        return ExpertStage


class _ExpertMatmuls:
    """Counts the expert weight-gradient matmuls dispatched while active: a
    matmul (``mm``, ``bmm``, ``addmm``, a grouped matmul, fxsplit's
    ``addmm_into``) whose result has an expert weight's shape and that does
    not read an expert weight (an input-gradient matmul reads one)."""

    def __init__(self, module: nn.Module) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        experts = [p for name, p in module.named_parameters() if name.endswith(("w_in", "w_out"))]
        weights = {p.untyped_storage().data_ptr() for p in experts}
        shapes = {tuple(p.shape) for p in experts} | {tuple(p.shape[1:]) for p in experts}
        names = {"mm", "bmm", "addmm", "_grouped_mm", "grouped_mm", "addmm_into"}
        ledger = self

        def reads_a_weight(args: Any) -> bool:
            return any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in weights for a in args)

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                out = func(*args, **(kwargs or {}))
                name = func._overloadpacket.__name__
                if name in names:
                    target = args[0] if name == "addmm_into" else out
                    operands = args[1:] if name == "addmm_into" else args
                    if (isinstance(target, torch.Tensor) and tuple(target.shape) in shapes
                            and not reads_a_weight(operands)):
                        ledger.count += 1
                return out

        self.count = 0
        self._mode = _Mode()

    def __enter__(self) -> _ExpertMatmuls:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
