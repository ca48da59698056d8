"""Memory between B and W, per stage layout.

For three layouts of the benchmark model (the body):

* ``middle``: the compiled body; input: hidden states requiring grad.
* ``last``: the compiled body under an eager head (``Linear(dim, vocab)``) and
  cross-entropy, the common last-stage layout; B must retain the eager part's
  autograd graph for W.
* ``first``: an embedding then the body, compiled as one region; input: token
  ids, so there is no input gradient to compute.

and three ways of splitting the backward:

* ``upstream``: ``torch.distributed.pipelining._backward.stage_backward_input``
  / ``stage_backward_weight`` on the plain compiled model (``backend="inductor"``,
  run with ``donated_buffer=False``, without which it fails). On a first stage
  upstream's split finds nothing to do at B, and its schedules run the whole
  backward at W for stage 0: that is what is measured for it (B: nothing,
  W: ``torch.autograd.backward``).
* ``fxsplit``: ``fxsplit.stage_backward_input`` / ``stage_backward_weight``
  on ``backend=fxsplit.backend()``, with today's defaults (``fxsplit.config``:
  recorded in the JSON).
* ``fxsplit-defer-all``: the same with ``backend=fxsplit.backend(defer="all")``,
  the strict placement (dW defers every weight-gradient computation, the cheap
  reductions included). The cut (what crosses) is fxsplit's minimal cut in both;
  the all-crossing cut is not something fxsplit can run, so its size is reported
  as a figure (``SplitResult.all_crossing_bytes``), not measured.

Figures per layout and way:

* ``alive_bytes``: allocator bytes allocated during one forward + B and still
  alive after B (stage output, returned input gradients and the input's
  ``.grad`` dropped): what the microbatch holds until W.
* ``declared_bytes``: what the split says it holds: fxsplit's
  ``PendingWeightGrads.held_bytes`` (compiled live-ins + the eager part of W's
  saved state), upstream's saved gradients in ``param_groups``.
* ``live_in_bytes`` / ``all_crossing_bytes``: the compiled regions'
  ``SplitResult.live_in_bytes`` and ``all_crossing_bytes`` evaluated at this
  microbatch's sizes (fxsplit only), and live-in bytes per token.
* ``zbv_peak_bytes``: the highest live bytes above the starting level over the
  ZB-V-like sequence :data:`ZBV_SEQUENCE` of 4 microbatches (inputs created
  beforehand).
* FLOPs of B and W (fxsplit; counted op by op on a ``compiler="eager"`` twin
  so that a dispatch mode sees every op Inductor would fuse). On the first
  stage, W's FLOPs are compared with the weight-gradient FLOPs: the W FLOPs of
  the same body as a middle stage (its input needs grad, so its W is only the
  weight-gradient leaves; an embedding's gradient has no FLOPs).
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import gc
import itertools
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxsplit
from fxsplit.bench.flops import flop_counter

__all__ = ["LAYOUTS", "MemoryMeter", "VARIANTS", "ZBV_SEQUENCE", "measure_memory_layouts"]

LAYOUTS = ("middle", "last", "first")
VARIANTS = ("upstream", "fxsplit", "fxsplit-defer-all")
MICROBATCHES = 4
# F F B F W B W ...: forward k, B k, W k for 4 microbatches, W trailing B by one step (ZB-V's steady state).
# --quick (a smoke test): every layout and every variant at least once, not every pair.
QUICK_GRID = (("middle", "upstream"), ("middle", "fxsplit"), ("middle", "fxsplit-defer-all"), ("last", "fxsplit"),
              ("first", "upstream"), ("first", "fxsplit"))
ZBV_SEQUENCE: tuple[tuple[str, int], ...] = (
    ("F", 0), ("F", 1), ("B", 0), ("F", 2), ("W", 0), ("B", 1), ("F", 3), ("W", 1), ("B", 2), ("W", 2), ("B", 3),
    ("W", 3),
)


class MemoryMeter:
    """Live allocator bytes above the level at the start of a window: the peak
    within the window and the level at named marks.

    CUDA: ``torch.cuda.memory_allocated`` / ``max_memory_allocated``. CPU: the
    allocation (+bytes) and free (-bytes) events the CPU allocator reports to
    ``torch.profiler`` with ``profile_memory=True``, summed in time order; a
    mark is a ``record_function`` event placed on the same clock. (Frees of
    blocks allocated before the window are not reported, which can only make
    the CPU figures higher, never lower.)
    """

    _PREFIX = "fxsplit_bench::"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0
        self.levels: dict[str, int] = {}
        self._base = 0

    @contextlib.contextmanager
    def window(self) -> Iterator[MemoryMeter]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            yield self
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._base
            return
        from torch.profiler import ProfilerActivity, profile

        with _without_profiler_chatter(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            yield self
        events = list(prof.profiler.kineto_results.events())
        mem = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
        times = [e.start_ns() for e in mem]
        running = list(itertools.accumulate((e.nbytes() for e in mem), initial=0))
        self.peak = max(running)
        for e in events:
            if e.name().startswith(self._PREFIX):
                self.levels[e.name()[len(self._PREFIX):]] = running[bisect.bisect_left(times, e.start_ns())]

    def mark(self, name: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.levels[name] = torch.cuda.memory_allocated(self.device) - self._base
        else:
            with torch.profiler.record_function(self._PREFIX + name):
                pass


# Kineto's C++ side prints one of these at every profiler start and stop (torch 2.13: "USDT:<time>
# <pid>:<tid> SyncActivityProfilerHandler.cpp:52] profiler_start"); KINETO_LOG_LEVEL does not
# silence them. A benchmark opens a profiler window per measurement, so they would bury its output.
_CHATTER = re.compile(rb"^(USDT|STAGE):\S+ \S+ \d+:\d+ \S+\.cpp:\d+\] ")


@contextlib.contextmanager
def _without_profiler_chatter() -> Iterator[None]:
    """While active, the process's stderr (file descriptor 2, where the C++ side writes) goes to a
    temporary file; at the end every line but the profiler's own start/stop chatter is written
    back to it, in order. Python's ``sys.stderr`` is flushed on both sides so nothing is lost."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no file descriptor 2 (an embedded interpreter): nothing to hold back
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = b"".join(line for line in held.read().splitlines(keepends=True) if not _CHATTER.match(line))
            if kept:
                sys.stderr.write(kept.decode(errors="replace"))
                sys.stderr.flush()


# -- stage layouts ---------------------------------------------------------
class LastStage(nn.Module):
    """``cross_entropy(head(body(x)), labels)``: ``body`` is compiled, the head and loss stay eager."""

    def __init__(self, body: nn.Module, dim: int, vocab: int, labels: torch.Tensor) -> None:
        super().__init__()
        self.body = body
        self.head = nn.Linear(dim, vocab, device=labels.device)
        self.register_buffer("labels", labels, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.body(x))
        return F.cross_entropy(logits.flatten(0, -2).float(), self.labels.flatten())


class FirstStage(nn.Module):
    """``body(embedding(ids))``: a first stage, compiled as one region."""

    def __init__(self, body: nn.Module, dim: int, vocab: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim, device=device, dtype=dtype)
        self.body = body

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.body(self.tok(ids))


class _Split:
    """B and W of one way of splitting the backward (see the module docstring)."""

    def __init__(self, variant: str, first: bool) -> None:
        self.variant, self.first = variant, first

    def context(self) -> contextlib.AbstractContextManager[None]:
        if self.variant == "upstream":
            import torch._functorch.config as functorch_config  # read at compile and at run time

            return functorch_config.patch(donated_buffer=False)
        return contextlib.nullcontext()

    def b(self, out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor,
          params: list[nn.Parameter]) -> Any:
        """B; returns what W needs (the autograd graph is kept alive by it)."""
        if self.variant != "upstream":
            _, pending = fxsplit.stage_backward_input([out], None if grad is None else [grad], [x], params)
            return pending
        if self.first:  # upstream's schedules run all of stage 0's backward at W
            return ("full", out, grad)
        from torch.distributed.pipelining import _backward as upstream

        _, groups = upstream.stage_backward_input([out], None if grad is None else [grad], [x], iter(params))
        return ("groups", groups)

    def w(self, held: Any, params: list[nn.Parameter]) -> None:
        if self.variant != "upstream":
            fxsplit.stage_backward_weight(params, held)
            return
        if held[0] == "full":
            _, out, grad = held
            torch.autograd.backward([out], None if grad is None else [grad])
            return
        from torch.distributed.pipelining import _backward as upstream

        upstream.stage_backward_weight(iter(params), held[1])

    def declared(self, held: Any) -> int | None:
        if self.variant != "upstream":
            return int(getattr(held, "held_bytes", held.live_in_bytes))
        if held[0] == "full":
            return None
        return sum(g.numel() * g.element_size() for group in held[1] for grads in group.get("grads") or ()
                   for g in grads or () if isinstance(g, torch.Tensor))


def _split_figures(pending: Any) -> dict[str, int | None]:
    """Evaluated ``live_in_bytes`` / ``all_crossing_bytes`` of the compiled regions B ran."""
    live = crossing = 0
    works = list(getattr(pending, "compiled", ()))
    if not works:
        return {"live_in_bytes": None, "all_crossing_bytes": None}
    for work in works:
        # fxsplit's own objects: the region's SplitResult and this microbatch's live-in values
        owner, values = getattr(work, "owner", None), getattr(work, "_live_ins", None) or []
        split = getattr(owner, "split", None)
        if split is None:
            return {"live_in_bytes": None, "all_crossing_bytes": None}
        try:
            bindings = split.live_in_bindings(values)
        except Exception:  # noqa: BLE001 - static shapes: nothing to bind
            bindings = {}
        live += split.live_in_bytes(bindings)
        crossing += split.all_crossing_bytes(bindings)
    return {"live_in_bytes": live, "all_crossing_bytes": crossing}


def _reset_dynamo() -> None:
    """``torch._dynamo.reset()`` before each compile of this section: every layout and variant
    compiles copies of the same ``forward``, one cache entry per backend, and past Dynamo's
    ``recompile_limit`` (8) a frame would silently run eagerly."""
    torch._dynamo.reset()


def _alive(fn: Callable[[], None], device: torch.device) -> int:
    gc.collect()
    meter = MemoryMeter(device)
    with meter.window():
        fn()
        gc.collect()
        meter.mark("end")
    return meter.levels["end"]


def _build_layout(layout: str, body: nn.Module, make_hidden: Callable[[], torch.Tensor], dim: int, vocab: int,
                  backend: Any) -> tuple[nn.Module, Callable[[], torch.Tensor], Callable[[torch.Tensor], Any]]:
    """(module to call, input factory, output gradient for an output) of ``layout``, compiled with ``backend``."""
    sample = make_hidden()
    device, dtype = sample.device, sample.dtype
    gen = torch.Generator(device="cpu").manual_seed(1)
    if layout == "middle":
        module = torch.compile(body, backend=backend)
        return module, make_hidden, lambda out: torch.ones_like(out) / out.numel()
    if layout == "last":
        labels = torch.randint(0, vocab, sample.shape[:-1], generator=gen).to(device)
        module = LastStage(torch.compile(body, backend=backend), dim, vocab, labels).to(dtype=dtype)
        return module, make_hidden, lambda out: None
    ids = torch.randint(0, vocab, sample.shape[:-1], generator=gen).to(device)
    first = FirstStage(body, dim, vocab, device, dtype)
    return torch.compile(first, backend=backend), lambda: ids.clone(), lambda out: torch.ones_like(out) / out.numel()


def _backend(variant: str, quick: bool) -> Any:
    compiler = "eager" if quick else "inductor"
    if variant == "upstream":
        return "aot_eager" if quick else "inductor"
    return fxsplit.backend(compiler=compiler, defer="all" if variant == "fxsplit-defer-all" else None)


def _measure_one(layout: str, variant: str, make: Callable[[Any], tuple[nn.Module, Callable[[], torch.Tensor],
                 Callable[[torch.Tensor], Any]]], device: torch.device, quick: bool, tokens: int) -> dict[str, Any]:
    split = _Split(variant, first=layout == "first")
    module, make_input, out_grad = make(_backend(variant, quick))
    params = list(module.parameters())
    row: dict[str, Any] = {"layout": layout, "variant": variant}

    def step(x: torch.Tensor) -> None:
        out = module(x)
        held = split.b(out, out_grad(out), x, params)
        del out
        split.w(held, params)

    before = fxsplit.compiled_regions()  # held, so that no new region can reuse an old one's id
    with split.context():
        for _ in range(1 if quick else 2):  # compile, then warm up
            step(make_input())
        old = {id(r) for r in before}
        if variant != "upstream" and all(id(r) in old for r in fxsplit.compiled_regions()):
            raise RuntimeError(f"fxsplit bench: the {layout} stage ({variant}) compiled no fxsplit region: "
                               "its figures would be eager ones")
        del before, old
        x = make_input()
        box: list[Any] = []

        def forward_and_b() -> None:
            out = module(x)
            box.append(split.b(out, out_grad(out), x, params))
            if x.requires_grad:
                x.grad = None  # the input gradient goes upstream

        row["alive_bytes"] = _alive(forward_and_b, device)
        held = box.pop()
        row["declared_bytes"] = split.declared(held)
        row.update(_split_figures(held) if variant != "upstream" else
                   {"live_in_bytes": None, "all_crossing_bytes": None})
        split.w(held, params)
        del held
        row["live_in_bytes_per_token"] = None if row["live_in_bytes"] is None else row["live_in_bytes"] / tokens

        xs = [make_input() for _ in range(MICROBATCHES)]
        outs: dict[int, Any] = {}
        pending: dict[int, Any] = {}
        meter = MemoryMeter(device)
        gc.collect()
        with meter.window():
            for phase, k in ZBV_SEQUENCE:
                if phase == "F":
                    outs[k] = module(xs[k])
                elif phase == "B":
                    out = outs.pop(k)
                    pending[k] = split.b(out, out_grad(out), xs[k], params)
                    del out
                    if xs[k].requires_grad:
                        xs[k].grad = None
                else:
                    split.w(pending.pop(k), params)
        row["zbv_peak_bytes"] = meter.peak
    return row


def _count_b_w(module: nn.Module, make_input: Callable[[], torch.Tensor], out_grad: Callable[[torch.Tensor], Any]
               ) -> dict[str, int]:
    params = list(module.parameters())
    x = make_input()
    out = module(x)  # compiles
    g = out_grad(out)
    with flop_counter() as fb:
        _, pending = fxsplit.stage_backward_input([out], None if g is None else [g], [x], params)
    del out
    with flop_counter() as fw:
        fxsplit.stage_backward_weight(params, pending)
    return {"B": fb.get_total_flops(), "W": fw.get_total_flops()}


def measure_memory_layouts(base: nn.Module, make_hidden: Callable[[], torch.Tensor], dim: int, vocab: int,
                           device: torch.device, quick: bool, say: Callable[[str], None] = lambda m: None,
                           upstream_unavailable: str | None = None) -> dict[str, Any]:
    """Every layout x variant of the module docstring; returns the JSON section ``memory``.

    ``base`` is the body (a middle stage taking ``make_hidden()``); it is
    copied, never changed. Resets Dynamo before each compile (modules compiled
    earlier recompile on their next call). ``quick`` compiles with eager compilers
    (``compiler="eager"``, ``aot_eager``): the same graphs and splits without
    code generation, a smoke test of the section. ``upstream_unavailable``:
    why upstream's split cannot run here; its rows are left out, the reason kept.
    """
    sample = make_hidden()
    tokens = sample.shape[:-1].numel()
    rows = []
    grid = QUICK_GRID if quick else tuple((layout, variant) for layout in LAYOUTS for variant in VARIANTS)
    if upstream_unavailable is not None:
        grid = tuple((layout, variant) for layout, variant in grid if variant != "upstream")
    flops: dict[str, dict[str, int]] = {}
    for layout, variant in grid:
        say(f"memory: {layout} stage, {variant}")
        _reset_dynamo()
        made: list[Any] = []

        def make(backend: Any, layout: str = layout) -> Any:
            made.append(_build_layout(layout, copy.deepcopy(base), make_hidden, dim, vocab, backend))
            return made[0]

        rows.append(_measure_one(layout, variant, make, device, quick, tokens))
        if quick and variant == "fxsplit" and layout in ("first", "middle"):
            flops[layout] = _count_b_w(*made[0])  # --quick's fxsplit rows already run compiler="eager"
        made.clear()  # the stage and its regions go before the next layout is built
    for layout in ("first", "middle"):
        if layout not in flops:
            say(f"memory: FLOPs of B and W on the {layout} stage (a compiler='eager' twin)")
            _reset_dynamo()
            twin = fxsplit.backend(compiler="eager")
            flops[layout] = _count_b_w(*_build_layout(layout, copy.deepcopy(base), make_hidden, dim, vocab, twin))
    _reset_dynamo()
    return {
        "layouts": list(LAYOUTS),
        "variants": {
            "upstream": "torch.distributed.pipelining._backward split on backend='inductor' (donated_buffer=False); "
            "first stage: B does nothing, W runs the whole backward (what upstream's schedules do for stage 0)",
            "fxsplit": f"fxsplit today: backend=fxsplit.backend(), fxsplit.config.defer={fxsplit.config.defer!r}, "
            "fxsplit's minimal cut",
            "fxsplit-defer-all": "backend=fxsplit.backend(defer='all'): strict placement, fxsplit's minimal cut",
        },
        "compiler": "eager (--quick: aot_eager / compiler='eager')" if quick else "inductor",
        "microbatches": MICROBATCHES,
        "zbv_sequence": " ".join(f"{p}{k}" for p, k in ZBV_SEQUENCE),
        "tokens_per_microbatch": tokens,
        "grid": "quick: " + ", ".join(f"{lay}/{var}" for lay, var in grid) if quick else "every layout x variant",
        "rows": rows,
        "flops": flops,
        "not_measurable": {} if upstream_unavailable is None else {"upstream": upstream_unavailable},
    }


def memory_targets(section: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Verdicts of the memory targets from the ``memory`` section (exact figures: no spread)."""
    out: dict[str, dict[str, Any]] = {}
    fx = [r for r in section["rows"] if r["variant"] == "fxsplit"]
    worst = max(fx, key=lambda r: r["alive_bytes"] / max(r["declared_bytes"] or 1, 1))
    ratio = worst["alive_bytes"] / max(worst["declared_bytes"] or 1, 1)
    out["alive_between_b_and_w"] = _exact(
        "alive_between_b_and_w", ratio <= 1.1, ratio, "<= 1.1",
        f"worst layout: {worst['layout']} ({worst['alive_bytes']} bytes alive, {worst['declared_bytes']} declared); "
        + ", ".join(f"{r['layout']} {r['alive_bytes'] / max(r['declared_bytes'] or 1, 1):.3f}" for r in fx))
    split = [r for r in fx if r["live_in_bytes"] is not None]
    cut_ok = bool(split) and all(r["live_in_bytes"] <= r["all_crossing_bytes"] for r in split)
    lower = [r["layout"] for r in split if r["live_in_bytes"] < r["all_crossing_bytes"]]
    ratios = [r["live_in_bytes"] / r["all_crossing_bytes"] for r in split if r["all_crossing_bytes"]]
    unsplit = [r["layout"] for r in fx if r["live_in_bytes"] is None]
    out["live_in_vs_all_crossing"] = _exact(
        "live_in_vs_all_crossing", cut_ok, max(ratios, default=float("nan")), "<= 1",
        f"strictly lower on: {', '.join(lower) or 'none'}; "
        + ", ".join(f"{r['layout']} {r['live_in_bytes']}/{r['all_crossing_bytes']}" for r in split)
        + (f"; no compiled region split at B (nothing to compare) on: {', '.join(unsplit)}" if unsplit else ""))
    first, middle = section["flops"]["first"], section["flops"]["middle"]
    ratio_w = first["W"] / middle["W"] if middle["W"] else float("nan")
    out["first_stage_w_flops"] = _exact(
        "first_stage_w_flops", first["W"] == middle["W"], ratio_w, "== 1",
        f"first stage: B {first['B']} W {first['W']} FLOPs; weight-gradient FLOPs (the same body's W as a middle "
        f"stage): {middle['W']}")
    return out


MEMORY_TARGETS = {
    "alive_between_b_and_w": "fxsplit: bytes alive between B and W <= 1.1 x declared held bytes (compiled live-ins "
    "+ eager W state), every stage layout",
    "live_in_vs_all_crossing": "fxsplit: live-in bytes <= the all-crossing cut's, every stage layout",
    "first_stage_w_flops": "fxsplit first stage: W FLOPs == weight-gradient FLOPs only",
}


def _exact(name: str, ok: bool, measured: float, target: str, detail: str) -> dict[str, Any]:
    return {"target": target, "measured": measured, "pass": bool(ok), "what": MEMORY_TARGETS[name], "detail": detail,
            "reliable": True, "unreliable_because": None, "verdict": "PASS" if ok else "MISS"}
