"""Runtime of fxsplit-compiled backward regions.

AOTAutograd calls :class:`CompiledSplitBackward` wherever it would call
Inductor's compiled backward. What it runs is decided per autograd *node* (one
node per forward call of the region), never per process:

* a node nobody registered (ordinary ``.backward()``, ``torch.autograd.grad``,
  another thread's backward, another model): the fused backward, exactly as
  ``backend="inductor"`` would (or dI then dW back to back when no fused
  graph was compiled);
* a node ``fxsplit.stage_backward_input`` (B) registered with an
  :class:`InputCall` for the duration of its autograd call: the dI graph
  only. The W work is recorded as a :class:`CompiledWeightWork` holding just
  the live-ins, and ``None`` is returned for every weight gradient;
* a node whose split already happened in B, registered as
  :data:`SPLIT_DONE` while W's eager autograd calls run (they may pass through
  it on the way to an eager weight): nothing; B and the dW graph have
  produced everything this node contributes.

Registrations are attributes on the node object (the AOTAutograd ``ctx``),
set before the autograd call and removed when it returns. The engine tells a
running backward which node it executes (:func:`~fxsplit._torch_internals.current_autograd_node`),
also on the CUDA engine's device threads, so no global phase is needed and
backward calls in other threads are untouched. B also runs a first stage's
bottom regions itself, outside the engine (:func:`run_directly`); the node
is then named by a thread-local for the duration of that call.
"""

from __future__ import annotations

import collections
import itertools
import logging
import operator
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, Protocol

import torch

from fxsplit import _torch_internals as ti
from fxsplit import config
from fxsplit.gradient_layout import GradientLayout, WeightGradient
from fxsplit.cudagraphs import RegionCapture, Slot, capture_backend, copy_exactly
from fxsplit.layouts import BoundaryGuard
from fxsplit.passes import SplitResult

log = logging.getLogger("fxsplit")

__all__ = [
    "SPLIT_DONE",
    "CompiledSplitBackward",
    "CompiledWeightWork",
    "DeferredGrad",
    "InputCall",
    "MAX_ACCUMULATING_LAYOUTS",
    "RegionGraphs",
    "registered",
    "run_directly",
]

# The attribute a node carries while a split backward call is registered on it.
_CALL_ATTR = "_fxsplit_split_call"
# Accumulating dW graphs compiled per region, at most: one per set of .grad layouts (strides, dtype,
# device) it adds into (see accumulating_graph). Not fxsplit.cudagraphs.MAX_GRAD_ADDRESS_SETS, which
# bounds the CUDA graphs captured per slot, one per set of .grad addresses: a layout compiles code,
# an address only needs another capture of the same code.
MAX_ACCUMULATING_LAYOUTS = 8
_UNCOMPILED: Any = object()  # (a key not compiled yet: None is "cannot be built")


class DeferredGrad:
    """An input gradient a region's dI graph produced in B that B's autograd
    call had no use for: it flows into ``node`` (at ``input_nr``), which only
    W's eager part runs. ``region_node`` is the region's autograd node."""

    __slots__ = ("region_node", "node", "input_nr", "value")

    def __init__(self, region_node: Any, node: Any, input_nr: int, value: torch.Tensor) -> None:
        self.region_node = region_node
        self.node = node
        self.input_nr = input_nr
        self.value = value


class InputCall:
    """One B autograd call, as the regions it runs see it: where they record
    their W work. :class:`fxsplit.pending.PendingWeightGrads` is one, so
    nothing is copied from one to the other.

    ``weight_ids``: the ``id`` of each weight given to B (a region keeps dW
    gradients for those only). ``compiled`` (one :class:`CompiledWeightWork`
    per region run) and ``deferred`` fill up while the call runs (appends are
    atomic: several engine threads may add); ``timings["b_graph_ns"]`` sums the
    time inside its dI graphs. ``plan``: B's
    :class:`~fxsplit.stage_plan.EagerWeightPlan`, read as it is
    (``region_params``, ``region_children``, ``region_starts``, ``rerun``).
    ``retains_graph``: the call keeps the graph (W re-runs eager nodes).
    ``release_first``: a region's node still holds its saved activations when
    its backward runs (B calls the node itself, :func:`run_directly`, or the
    engine call keeps the graph); unless W re-runs it (``plan.rerun``), the
    region lets go of them before its dI graph runs, as AOTAutograd does under
    an engine call that keeps no graph, so dI frees each after its last use.
    ``direct``: B calls the node as :data:`fxsplit.config.direct_b` allows
    (counted in ``direct_b_runs``).
    """

    # Set by the implementation (PendingWeightGrads.__init__):
    _weights: Sequence[Any]
    plan: Any
    compiled: list[CompiledWeightWork]
    deferred: list[DeferredGrad]
    timings: dict[str, int]
    # What a stage of compiled regions only needs, unless B says otherwise.
    retains_graph = False
    release_first = False
    direct = False
    _weight_ids: frozenset[int] | None = None

    @property
    def weight_ids(self) -> frozenset[int]:
        """The ``id`` of every weight given to B (made on first use)."""
        if self._weight_ids is None:
            self._weight_ids = frozenset(id(w) for w in self._weights)
        return self._weight_ids


class _SplitDone:
    """Registration for W: this node's split already happened in B."""

    def __repr__(self) -> str:
        return "SPLIT_DONE"


SPLIT_DONE = _SplitDone()


_OVERLAP = (
    "fxsplit: another split backward is running through this microbatch's autograd graph "
    "({} is registered by it); B and W of one microbatch cannot overlap"
)


class registered:  # noqa: N801 - used as a function: ``with registered(nodes, call):``
    """Register ``call`` on each autograd node of ``nodes`` for the duration of the block.

    Entering raises ``RuntimeError``, registering nothing, if another split
    backward call holds one of them (two calls running through the same
    autograd graph at once, e.g. B twice on one microbatch from two threads).
    A class rather than a generator-based context manager: B enters one per
    call, and on a host-bound stage every line run around the graphs counts.
    """

    __slots__ = ("_nodes", "_call")

    def __init__(self, nodes: Sequence[Any], call: InputCall | _SplitDone) -> None:
        self._nodes = nodes
        self._call = call

    def __enter__(self) -> None:
        nodes, call = self._nodes, self._call
        if not all(map(operator.is_, map(getattr, nodes, _CALL_ATTRS, _NONES), _NONES)):  # (C-level passes)
            held = next(n for n in nodes if getattr(n, _CALL_ATTR, None) is not None)
            raise RuntimeError(_OVERLAP.format(type(held).__name__))
        try:
            collections.deque(map(setattr, nodes, _CALL_ATTRS, itertools.repeat(call)), maxlen=0)
        except BaseException:  # (a node that takes no attribute: those set are unset)
            for node in nodes:
                if getattr(node, _CALL_ATTR, None) is call:
                    setattr(node, _CALL_ATTR, None)
            raise

    def __exit__(self, *exc: object) -> None:
        collections.deque(map(setattr, self._nodes, _CALL_ATTRS, _NONES), maxlen=0)


_CALL_ATTRS = itertools.repeat(_CALL_ATTR)  # (endless: map stops at its nodes' end)
_NONES = itertools.repeat(None)


# The node run_directly is running on this thread (the engine reports none
# then), and the _Probe of a call that learns the node's AotCall.
_direct = threading.local()
_SHAPE = operator.attrgetter("shape")
_STRIDE = operator.methodcaller("stride")
# On a region's autograd node class: its AotCall (which knows its CompiledSplitBackward).
_AOT_CALL = "_fxsplit_aot_call"


class AotCall:
    """How AOTAutograd's backward wrapper made a region's compiled-backward
    arguments from its node, so that B can make them itself and call the
    region's dI graph with no wrapper in between.

    Learned from one B call through the wrapper (:func:`route_backward`) and
    kept only where that call showed the wrapper to be bookkeeping: its
    arguments were the node's saved values
    (:func:`fxsplit._torch_internals.aot_saved_args`, checked by
    :meth:`_Probe.read`) followed by the incoming gradients themselves (the
    same plain tensor objects), and it returned the backward's results
    themselves (no token, RNG-offset or subclass epilogue). The guard
    (:meth:`run`): as many incoming gradients, those used plain tensors with
    the learned shapes and strides (which decide the wrapper's layout
    coercion), the same :func:`fxsplit._torch_internals.aot_backward_state`
    (learned with autocast and grad mode off), as many saved values. A miss
    goes through the wrapper and learns again. Kept on the node's class (one
    compiled variant of a region).
    """

    __slots__ = ("owner", "prefix", "tangents", "layouts", "state")

    def __init__(
        self, owner: CompiledSplitBackward, prefix: int, tangents: tuple[int, ...], layouts: list[Any],
        state: tuple[bool, ...],
    ) -> None:
        self.owner = owner
        self.prefix = prefix
        self.tangents = tangents
        self.layouts = layouts
        self.state = state

    def run(self, call: InputCall, node: Any, grads: Any) -> tuple[Any, ...] | None:
        """B's call (``call``) of the region's compiled backward for ``node``,
        on the arguments the wrapper would pass, given ``grads`` (the
        gradients flowing into its inputs, by input number); ``None``, having
        run nothing, where the guard misses. A list ``grads`` (the engine's
        boxed gradients) is emptied: the arguments hold them, as the wrapper's do."""
        if len(grads) != len(self.tangents) or ti.aot_backward_state() != self.state:
            return None
        try:
            gs = list(map(grads.__getitem__, self.tangents))
        except (KeyError, IndexError):  # (learned from gradients by output number, given a list, or the reverse)
            return None
        if not ti.all_plain(gs) or list(zip(map(_SHAPE, gs), map(_STRIDE, gs))) != self.layouts:
            return None
        args = ti.aot_saved_args(node)
        if len(args) != self.prefix:
            return None
        if type(grads) is list:
            grads.clear()
        args += gs
        return self.owner.run_unwrapped(call, node, args)

    @staticmethod
    def learn(probe: _Probe, results: Sequence[Any]) -> AotCall | None:
        """The :class:`AotCall` that ``probe``'s call through the wrapper shows,
        or ``None`` where the wrapper did more than bookkeeping."""
        tangents, grads, state = probe.tangents, probe.grads, probe.state
        if tangents is None or probe.result is None or state[0] or state[3]:  # (autocast on, grad mode on)
            return None
        if len(results) != len(probe.result) or not all(map(operator.is_, results, probe.result)):
            return None
        gs = [grads[k] for k in tangents]
        if any(type(g) is not torch.Tensor for g in gs):
            return None
        return AotCall(probe.owner, probe.prefix_len, tangents, [(g.shape, g.stride()) for g in gs], state)


class _Probe:
    """What :func:`route_backward` needs to learn an :class:`AotCall`: the node,
    the gradients given, and what :meth:`read` and
    :meth:`CompiledSplitBackward.__call__` saw of the wrapper's call."""

    __slots__ = ("node", "grads", "state", "parts", "prefix_len", "tangents", "result", "owner")

    def __init__(self, node: Any, grads: Mapping[int, Any] | Sequence[Any]) -> None:
        self.node = node
        self.grads = grads if isinstance(grads, Mapping) else tuple(grads)  # (the wrapper empties a boxed list)
        self.state = ti.aot_backward_state()
        # (read before the wrapper runs: under an engine call that frees the graph it clears the saved tensors)
        self.parts = ti.aot_saved_parts(node)
        self.prefix_len = 0
        self.tangents: tuple[int, ...] | None = None
        self.result: list[Any] | None = None
        self.owner: CompiledSplitBackward | None = None

    def read(self, owner: CompiledSplitBackward, args: list[Any]) -> None:
        """Compare the wrapper's arguments ``args`` with the node's saved
        values (:func:`fxsplit._torch_internals.aot_saved_parts`: the symbolic
        sizes and opaque objects themselves, as many tensors as it saved,
        read without unpacking them again) and the gradients: ``tangents`` is
        the input number of each gradient argument where they are those,
        unchanged, in that order; else ``None``."""
        self.owner = owner
        parts = self.parts
        if parts is None:
            return
        symints, saved, opaque = parts
        n = self.prefix_len = len(symints) + saved + len(opaque)
        if len(args) != n + len(self.grads):
            return
        middle = args[len(symints):len(symints) + saved]
        if not (
            args[:len(symints)] == symints
            and all(isinstance(t, torch.Tensor) or t is None for t in middle)
            and all(map(operator.is_, args[n - len(opaque):n], opaque))
        ):
            return
        grads = self.grads
        by_id = {id(g): k for k, g in (grads.items() if isinstance(grads, Mapping) else enumerate(grads))}
        tangents = tuple(by_id.get(id(t), -1) for t in args[n:])
        if -1 not in tangents and len(set(tangents)) == len(tangents):
            self.tangents = tangents


def run_directly(node: Any, grads: dict[int, torch.Tensor], call: InputCall | None = None) -> tuple[torch.Tensor | None, ...]:
    """Run region ``node``'s backward outside the engine, on the gradients
    ``grads`` flowing into its inputs, as its registration says (B: the dI
    graph only): the gradient for each of its ``next_functions``. Its W
    work goes where the registration sends it (records, hand-overs); the
    weight gradients returned are ``None`` in B. ``call``: B's call, for a
    node not registered yet: it is registered for this call only, and
    ``RuntimeError`` is raised, running nothing, where another split call
    holds it (as :class:`registered` does). Where the node's :class:`AotCall`
    guard holds, this is :func:`route_backward`'s unwrapped call, made here."""
    enabled, held = torch.is_grad_enabled(), getattr(node, _CALL_ATTR, None)
    if call is not None:
        if held is not None:
            raise RuntimeError(_OVERLAP.format(type(node).__name__))
        setattr(node, _CALL_ATTR, call)
    ti.set_grad_enabled(False)  # (as the engine runs a backward that does not create a graph)
    try:
        b_call = call if call is not None else held  # (B's: an InputCall; SPLIT_DONE and None take route_backward's way)
        known = type(node).__dict__.get(_AOT_CALL) if isinstance(b_call, InputCall) and config.skip_aot_wrapper else None
        results = known.run(b_call, node, grads) if known is not None else None
        return results if results is not None else route_backward(node, grads, _outside_engine, (grads,))
    finally:
        ti.set_grad_enabled(enabled)
        if call is not None:
            setattr(node, _CALL_ATTR, None)


def _outside_engine(node: Any, grads: dict[int, torch.Tensor]) -> Any:
    """AOTAutograd's backward of ``node``, called by B itself: the node is
    made known to :meth:`CompiledSplitBackward.__call__` (the engine reports none)."""
    prev = getattr(_direct, "node", None)
    _direct.node = node
    try:
        return ti.run_node_outside_engine(node, grads)
    finally:
        _direct.node = prev


def route_backward(node: Any, grads: Sequence[Any], wrapped: Callable[..., Any], args: Sequence[Any]) -> Any:
    """A split region's node run by autograd (the engine, or B itself:
    :func:`run_directly`), installed on its class by
    :func:`fxsplit._torch_internals.route_backward_of`: ``grads`` are the
    gradients flowing into its inputs, ``wrapped(node, *args)`` runs
    AOTAutograd's backward. Outside B (ordinary backward, W) that is all. In
    B, where the node's :class:`AotCall` is known and its guard holds, the
    region's compiled backward is called with no AOTAutograd wrapper;
    otherwise through it, learning the :class:`AotCall` for the next call
    (unless :data:`fxsplit.config.skip_aot_wrapper` is off)."""
    call = getattr(node, _CALL_ATTR, None)
    if call is None or call is SPLIT_DONE or config.skip_aot_wrapper is False:
        return wrapped(node, *args)
    known = type(node).__dict__.get(_AOT_CALL)
    results = known.run(call, node, grads) if known is not None else None
    if results is not None:
        return results
    prev = getattr(_direct, "probe", None)
    _direct.probe = probe = _Probe(node, grads)
    try:
        results = wrapped(node, *args)
    finally:
        _direct.probe = prev
    learned = AotCall.learn(probe, results) if probe.owner is not None else None
    if learned is not None:  # (a call the wrapper changed leaves an earlier one's AotCall as it was)
        setattr(type(node), _AOT_CALL, learned)
    return results


# What a region's dW graph gives W: the weights, their grad accumulators and their
# gradients, as three lists of one length (CompiledWeightWork.compute).
Gradients = tuple[Sequence[torch.Tensor], Sequence[Any], Sequence[torch.Tensor]]


class CompiledWeightWork:
    """The W half of one compiled region for one microbatch: dW graph + live-ins.

    Holds only the live-ins and the parameters the gradients belong to (those
    given to B; ``None`` in the other positions; one per
    :attr:`CompiledSplitBackward.weight_grads`), so everything else the
    backward needed is freed when B ends. :meth:`compute` is pure and may be
    called again (a retried W); :meth:`accumulate` adds some gradients into
    ``.grad`` inside the dW graph (that *is* their commit); :meth:`release`
    drops the live-ins once W has committed the gradients.
    """

    # Defaults, replaced (never mutated) where an instance differs:
    # The CUDA graph slot whose buffers hold the live-ins (fxsplit.cudagraphs), held until release.
    slot: Slot | None = None
    # held_elsewhere and live_in_storages, once read.
    _held: frozenset[int] | None = None
    _storages: set[int] | None = None

    def __init__(
        self,
        owner: CompiledSplitBackward,
        live_ins: list[Any],
        params: list[torch.Tensor | None],
        accumulators: list[Any] | None = None,
        slot: Slot | None = None,
        b_storages: AbstractSet[int] = frozenset(),
    ) -> None:
        self.owner = owner  # (the region's CompiledSplitBackward)
        self._live_ins: list[Any] | None = live_ins
        self.params = params
        # Whether every weight gradient's weight was given to B (none of params is None).
        self.complete = not any(map(operator.is_, params, _NONES))
        # Each param's grad accumulator, as the region's autograd node links it
        # (None where params has None): W hands the gradients to these.
        self.accumulators = accumulators if accumulators is not None else [None] * len(params)
        # Storages, as B left them, of the input gradients it returned and of the
        # live-ins that are the backward's own inputs (see held_elsewhere).
        self._b_storages: AbstractSet[int] = b_storages
        if slot is not None:
            self.slot = slot
            slot.hold(self)

    @property
    def region(self) -> str:
        return self.owner.name

    @property
    def live_in_bytes(self) -> int:
        return sum(
            v.numel() * v.element_size() for v in (self._live_ins or []) if isinstance(v, torch.Tensor)
        )

    @property
    def pending(self) -> bool:
        return self._live_ins is not None

    @property
    def weights(self) -> list[torch.Tensor]:
        """The weights (given to B) this region computes gradients for."""
        return [p for p in self.params if p is not None]

    def _check(self) -> list[Any]:
        if self._live_ins is None:
            raise RuntimeError(f"fxsplit: the W work of {self.region} has already been committed")
        return self._live_ins

    def _select(self, grads: Sequence[Any], wanted: AbstractSet[int] | None) -> Gradients:
        """The weights, grad accumulators and gradients W commits of this
        region's, as three lists: those given to B, whose ``id`` is in
        ``wanted`` (all when ``None``), with a gradient (``None``: accumulated
        inside the dW graph). The caller must not change the lists."""
        params, none = self.params, _NONES
        if self.complete and (wanted is None or wanted.issuperset(map(id, params))) and not any(
            map(operator.is_, grads, none)
        ):  # every weight given to B and wanted, every gradient computed (the common case)
            return params, self.accumulators, grads
        if all(map(operator.is_, grads, none)):  # every gradient accumulated inside the dW graph
            return (), (), ()
        kept = [(p, acc, g) for p, acc, g in zip(params, self.accumulators, grads)
                if p is not None and g is not None and (wanted is None or id(p) in wanted)]
        return [t[0] for t in kept], [t[1] for t in kept], [t[2] for t in kept]

    def compute(self, wanted: AbstractSet[int] | None = None, timings: dict[str, int] | None = None) -> Gradients:
        """Run the dW graph; the weights, grad accumulators and gradients (:meth:`_select`)
        of the weights whose ``id`` is in ``wanted`` (all when ``None``). Changes nothing
        observable: the live-ins stay held until :meth:`release`. The time
        inside the graph is added to ``timings["w_graph_ns"]``."""
        # Pass a copy: compiled graphs clear their argument list.
        outs = self.owner.run_dw(list(self._check()), timings, self.slot)
        return self._select(self.owner.weight_gradient_values(outs), wanted)

    def accumulate(
        self,
        graph: ti.BoxedCallable,
        positions: Sequence[int],
        grads: list[torch.Tensor],
        wanted: AbstractSet[int] | None = None,
        timings: dict[str, int] | None = None,
    ) -> Gradients:
        """Run ``graph``, the dW graph accumulating the gradients of the weights
        at ``positions`` (indices into :attr:`params`, plain weights) into their
        ``.grad``, ``grads`` (:meth:`CompiledSplitBackward.accumulating_graph`),
        and return the other gradients as :meth:`compute` does. Not pure: once
        called, the weights at ``positions`` count as accumulated."""
        outs = self.owner.run_dw(list(self._check()) + grads, timings, self.slot, graph, tuple(positions))
        self.owner.accumulating_runs += 1
        # In-place writes of compiled kernels do not bump the version counter
        # that autograd's own in-place accumulation bumps.
        torch.autograd.graph.increment_version(grads)
        return self._select(self.owner.weight_gradient_values(outs), wanted)

    def live_in_storages(self) -> set[int]:
        """Data pointers of the live-ins' storages (a ``.grad`` sharing one must
        not be written inside the graph that reads it)."""
        if self._storages is None:
            live = self._live_ins or []
            if ti.all_plain(live):  # the common case, read in bulk
                self._storages = ti.storage_ptrs(live)
            else:  # subclass live-ins too (their storage_ptr decides), other values skipped
                self._storages = {ti.storage_ptr(v) for v in live if isinstance(v, torch.Tensor)}
        return self._storages

    @property
    def held_elsewhere(self) -> frozenset[int]:
        """Storages (data pointers) of plain tensors others hold too, while the
        live-ins are held: the live-ins that are the backward's own inputs,
        and the input gradients B returned that are live-ins as well. A dW
        output in one of them is someone else's, as autograd would see it.
        A dW graph's outputs share storage only with its inputs (the
        live-ins), so an input gradient that is no live-in is left out: its
        storage may have been freed since B and be a new output's. (B read
        the storages of both kinds, ``b_storages``; the backward's own inputs
        among the live-ins are live-ins.)"""
        if self._held is None:
            self._check()
            self._held = frozenset(self._b_storages & self.live_in_storages()) if self._b_storages else frozenset()
        return self._held

    def holds_none_of(self, ptrs: set[int]) -> bool:
        """Whether none of the storages ``ptrs`` (data pointers) is in
        :attr:`held_elsewhere`, reading the live-ins only as far as that needs:
        the storages B read are few, and only one of them among ``ptrs``
        calls for the storages of every live-in."""
        if self._held is not None:
            return ptrs.isdisjoint(self._held)
        return ptrs.isdisjoint(self._b_storages) or ptrs.isdisjoint(self.held_elsewhere)

    def release(self) -> None:
        self._live_ins = None
        self._storages = None
        self._held = None
        if self.slot is not None:
            self.slot.release()
            self.slot = None


class RegionGraphs(Protocol):
    """The graphs of one region, compiled on demand (the backend provides them).

    ``compile(kind)`` compiles ``"dI"``, ``"dW"`` (after dI: it reads dI's
    output layout) or ``"fused"`` and returns it (boxed); a failure either
    raises :class:`~fxsplit.FxsplitCompileError` or, after one warning,
    returns the graph uncompiled. ``compile_accumulating(positions, grads)``
    returns the dW graph that accumulates its outputs at ``positions`` into
    tensors laid out as ``grads``, or ``None`` where it cannot be built.
    ``compile_seconds`` records the time each compile took.
    ``di_boundary()`` says what the consumers of dI's outputs were compiled
    for (:class:`fxsplit.layouts.BoundaryGuard`; after dW is compiled).
    """

    compile_seconds: dict[str, float]

    def compile(self, kind: str) -> ti.BoxedCallable: ...

    def di_boundary(self) -> tuple[list[Any], list[str], list[bool]]: ...

    def forward_cudagraphs_notice(self) -> Callable[[], None] | None: ...

    def compile_accumulating(
        self, positions: tuple[int, ...], grads: Sequence[torch.Tensor]
    ) -> ti.BoxedCallable | None: ...


class CompiledGraphs:
    """A region's compiled graphs and their variants, each compiled when first
    asked for (``graphs``, the backend, compiles them): ``"dI"``, ``"dW"``,
    ``"fused"`` (where ``fused_backward``) and the dW variants that accumulate
    into ``.grad``. ``_run_di``, ``_run_dw`` and ``_run_fused`` are what calls
    each now: from its third call on, Inductor's generated code itself
    (:meth:`_callable`). Compiling is thread-safe.
    """

    def __init__(self, graphs: RegionGraphs, fused_backward: bool = True) -> None:
        self.graphs = graphs
        self.fused_backward = fused_backward
        self._lock = threading.Lock()
        self._compiled: dict[Any, ti.BoxedCallable | None] = {}
        # Callables that tools and tests put in place of a graph (see _run_di).
        self._replaced: dict[str, ti.BoxedCallable] = {}
        # Per graph kind: called once through its compiled wrapper, and what to
        # call from then on (the generated code, or the graph itself where it
        # has none; see _callable).
        self._called: set[Any] = set()
        self._inner: dict[Any, ti.BoxedCallable] = {}

    @property
    def compile_seconds(self) -> dict[str, float]:
        """Seconds each graph took to compile (``"fused"``, ``"dI"``, ``"dW"``,
        ``"dW+accumulate"``), for the graphs compiled so far."""
        return dict(self.graphs.compile_seconds)

    @property
    def compiled_graphs(self) -> tuple[str, ...]:
        """The graphs compiled so far, in the order they were compiled
        (``"dW+accumulate"`` once per variant of accumulated outputs and ``.grad`` layouts)."""
        return tuple(k if isinstance(k, str) else k[0] for k in self._compiled)

    # -- compiling on first use -----------------------------------------------
    # The graphs as the runtime calls them: compiled on first access. Assigning
    # replaces one (tools that time or fail a graph wrap what they read);
    # properties rather than stored callables, so no reference cycle keeps
    # a region alive after its compiled code is gone.
    @property
    def _run_di(self) -> ti.BoxedCallable:
        return self._replaced.get("dI") or self._callable("dI")

    @_run_di.setter
    def _run_di(self, fn: ti.BoxedCallable) -> None:
        self._replaced["dI"] = fn

    @property
    def _run_dw(self) -> ti.BoxedCallable:
        return self._replaced.get("dW") or self._callable("dW")

    @_run_dw.setter
    def _run_dw(self, fn: ti.BoxedCallable) -> None:
        self._replaced["dW"] = fn

    @property
    def _run_fused(self) -> ti.BoxedCallable | None:
        if not self.fused_backward:
            return None
        return self._replaced.get("fused") or self._callable("fused")

    @_run_fused.setter
    def _run_fused(self, fn: ti.BoxedCallable) -> None:
        self._replaced["fused"] = fn

    def _callable(self, kind: str) -> ti.BoxedCallable:
        """What calls graph ``kind`` now: from its second call on, while nothing
        observes each graph call (:func:`ti.graph_calls_observed`), Inductor's
        generated code itself rather than the ``CompiledFxGraph`` around it
        (:func:`ti.generated_call`), whose per-call work after the first call
        is the profiler's record and runtime metrics (on a host-bound stage
        its lines cost B + W about 1 % of the whole backward, measured in
        pairs on this project's CPU); the first call always goes through it."""
        inner = self._inner.get(kind)
        if inner is not None and not ti.graph_calls_observed():
            return inner
        return self._called_once_more(kind, self._graph(kind))

    def _called_once_more(self, key: Any, fn: ti.BoxedCallable) -> ti.BoxedCallable:
        """``fn`` (compiled graph ``key``), noting the call: from its second
        call on, :meth:`_callable` may call the generated code itself."""
        if key in self._called:
            self._inner[key] = ti.generated_call(fn) or fn
        else:
            self._called.add(key)
        return fn

    def _graph(self, kind: str) -> ti.BoxedCallable:
        fn = self._compiled.get(kind)
        if fn is not None:
            return fn
        if kind == "dW":
            self._graph("dI")  # dW is compiled for the layout compiled dI gives its live-ins
        with self._lock:
            fn = self._compiled.get(kind)
            if fn is None:
                fn = self.graphs.compile(kind)
                self._compiled[kind] = fn
        return fn

    def compile(self, *kinds: str) -> None:
        """Compile the graphs ``kinds`` now, if not yet compiled."""
        for kind in kinds:
            self._graph(kind)

    def prepare_split(self) -> None:
        """Compile the dI and dW graphs if they are not yet (B calls this before its autograd call)."""
        if "dW" not in self._compiled:
            self.compile("dI", "dW")

    @staticmethod
    def accumulating_key(positions: tuple[int, ...], grads: Sequence[torch.Tensor]) -> tuple[Any, ...]:
        """Which accumulating dW variant adds the outputs at ``positions`` into
        tensors laid out as ``grads`` (:meth:`accumulating_graph`)."""
        return ("dW+accumulate", positions, tuple((tuple(g.stride()), g.dtype, g.device) for g in grads))

    def accumulating_graph(
        self, positions: tuple[int, ...], grads: Sequence[torch.Tensor], key: tuple[Any, ...] | None = None
    ) -> ti.BoxedCallable | None:
        """The dW graph that accumulates its outputs at ``positions`` into
        tensors laid out as ``grads``, compiled on first use (``None`` if the
        backend cannot build it). ``key``: :meth:`accumulating_key` of the
        two, where the caller kept it (W's commit plan does, behind a guard
        on the ``.grad`` tensors' metadata). Called as :meth:`_callable`
        calls a graph: from its third call on, its generated code itself."""
        if key is None:
            key = self.accumulating_key(positions, grads)
        inner = self._inner.get(key)  # (set once the variant compiled and ran through its wrapper)
        if inner is not None and not ti.graph_calls_observed():
            return inner
        fn = self._compiled.get(key, _UNCOMPILED)
        if fn is _UNCOMPILED:
            self._graph("dW")  # the variant is compiled for the live-ins' layout, as dW
            with self._lock:
                if key not in self._compiled:
                    variants = sum(1 for k in self._compiled if not isinstance(k, str))
                    # A .grad whose layout keeps changing would compile without end: stop at a few.
                    fit = variants < MAX_ACCUMULATING_LAYOUTS
                    self._compiled[key] = self.graphs.compile_accumulating(positions, grads) if fit else None
                fn = self._compiled[key]
        return None if fn is None else self._called_once_more(key, fn)



def _weight_grad_dtypes(split: SplitResult, weight_grads: Sequence[WeightGradient]) -> tuple[torch.dtype | None, ...]:
    """The dtype of each weight's gradient as the dW graph computes it (``None``
    where unknown, and for a subclass gradient)."""
    out_vals = [n.meta.get("val") if isinstance(n, torch.fx.Node) else None
                for n in split.dw_graph.graph.output_node().args[0]] if split.dw_outputs else []
    return tuple(
        None if g.subclass or len(g.positions) != 1 or len(out_vals) != len(split.dw_outputs)
        or not isinstance(out_vals[g.positions[0]], torch.Tensor)
        else out_vals[g.positions[0]].dtype
        for g in weight_grads
    )


def _passthrough_and_tangents(
    split: SplitResult,
) -> tuple[tuple[int, ...], tuple[int, ...], frozenset[int]]:
    """Where dI's outputs hold the live-ins that are the backward's own inputs
    (after dI's own outputs); where the same live-ins are among W's live-ins
    (dI's outputs after its own); and the output gradients among dI's inputs
    (copied into a CUDA graph slot, not keying it)."""
    n = len(split.di_outputs)
    passthrough = tuple(
        n + k for k, live in enumerate(split.live_ins) if live.source == "input" and live.kind == "tensor"
    )
    return passthrough, tuple(i - n for i in passthrough), frozenset(ti.tangent_positions(split.di_graph))


def _output_places(split: SplitResult) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Where each backward output is found in ``[*dI's outputs, None]`` and in
    ``[*dI's, *dW's, None]`` (:meth:`CompiledSplitBackward._assemble`)."""
    place = {i: k for k, i in enumerate((*split.di_outputs, *split.dw_outputs))}
    n_di, n_all = len(split.di_outputs), len(place)
    di_places = tuple(place[i] if place.get(i, n_di) < n_di else n_di for i in range(split.num_outputs))
    return di_places, tuple(place.get(i, n_all) for i in range(split.num_outputs))


class CompiledSplitBackward(CompiledGraphs):
    """The backward of one fxsplit-compiled region, as AOTAutograd calls it.

    ``_run_di(args)`` returns the dI outputs followed by the live-ins;
    ``_run_dw(live_ins)`` the weight gradients; ``_run_fused(args)`` the whole
    backward. All follow AOTAutograd's boxed convention. Each graph is
    compiled when first used (unless the backend compiled it already):
    ordinary backward compiles the fused graph only, B the dI/dW pair only
    (:meth:`prepare_split`, before B's autograd call, so a compile error
    raises before anything runs).

    Inspection: ``stats`` counts graph runs (``fused_runs``, ``di_runs``,
    ``dw_runs``; a dW run that accumulates into ``.grad`` counts as a dW run
    and also in ``accumulating_runs``; a dI run B made by calling the
    region's node itself rather than through autograd's engine, see
    :data:`fxsplit.config.direct_b`, also in ``direct_b_runs``, and in ``unwrapped_b_runs`` where
    it also skipped AOTAutograd's wrapper, see :class:`AotCall`), ``graph_ns`` the time spent inside
    each kind of graph, ``compile_seconds`` the time each compile took.
    """

    # Set by _decide_capture on the first split call (class defaults until then):
    _capture: RegionCapture | None = None
    _capture_decided = False
    _plain_di = False  # no CUDA graphs, no cudagraph trees in the forward: every dI runs as it is
    # With CUDA graphs, the forward replays through Inductor's cudagraph
    # trees: what B tells them when dI runs, and the live-ins that are the
    # backward's own inputs (saved activations in the trees' memory), which
    # W must not read there (the trees may free them): dI's outputs copy them.
    _tree_notice: Callable[[], None] | None = None

    def __init__(
        self,
        split: SplitResult,
        graphs: RegionGraphs,
        name: str,
        layout: GradientLayout | None = None,
        fused_backward: bool = True,
        fused_accumulation: bool | None = None,
        cudagraphs: bool = False,
    ) -> None:
        super().__init__(graphs, fused_backward)
        # An instance attribute, so wrappers that copy __dict__ (torch._dynamo.disable) keep it.
        self._boxed_call = True
        # Replay dI and dW as CUDA graphs where they can (fxsplit.cudagraphs);
        # decided on the first split call, from its tensors (_decide_capture).
        self.cudagraphs = cudagraphs
        self._passthrough, self.passthrough_at, self._tangents = _passthrough_and_tangents(split)
        self._di_places, self._places = _output_places(split)
        self.split = split
        self.name = name
        # None: fxsplit.config.fused_accumulation decides at W; False: never.
        self.fused_accumulation = fused_accumulation
        # Which forward input each backward output is (part of) the gradient
        # of: the autograd node has an edge per tensor input only, and a
        # DTensor weight's gradient is several outputs.
        self.layout = layout if layout is not None else GradientLayout.plain(split.num_outputs)
        # One per weight, in dW output order: the pieces W hands to autograd as one gradient.
        self.weight_grads: tuple[WeightGradient, ...] = self.layout.weight_gradients(split.dw_outputs)
        # The autograd node's edges (one per tensor input), and per weight
        # gradient the index of its weight's edge among them (None where it
        # has none), decided once; where every one has an edge (the common
        # case), _record reads them in one C-level pass.
        flags = self.layout.input_is_tensor
        self._num_edges = sum(flags)
        self._n_di = len(self.split.di_outputs)
        self._has_subclass_inputs = bool(self.layout.subclass_inputs)
        self._weight_edges: tuple[int | None, ...] = tuple(
            sum(flags[: g.input_index]) if g.input_index < len(flags) and flags[g.input_index] else None
            for g in self.weight_grads
        )
        self._every_weight_edge = None not in self._weight_edges
        # Builds DTensor gradients from their pieces; read off the region's
        # autograd node by the first split backward (see _input_only).
        self._subclass_grads: ti.SubclassGradients | None = None
        self.stats = {"fused_runs": 0, "di_runs": 0, "dw_runs": 0}
        self.accumulating_runs = self.direct_b_runs = self.unwrapped_b_runs = 0
        self.graph_ns = {"fused": 0, "dI": 0, "dW": 0}
        # Conforms what compiled dI returns to what autograd and dW expect
        # (built with dW, whose input layouts it checks).
        self._boundary: BoundaryGuard | None = None
        # The dtype of each weight's gradient (None where unknown, and for a
        # subclass gradient): .grad must match for the gradient to be
        # accumulated inside the graph.
        self.weight_grad_dtypes = _weight_grad_dtypes(split, self.weight_grads)

    def __repr__(self) -> str:
        return f"<CompiledSplitBackward {self.name} stats={self.stats}>"

    def dw_positions(self, weights: Sequence[int]) -> tuple[int, ...]:
        """The dW output positions of the gradients of plain weights ``weights``
        (indices into :attr:`weight_grads`), for :meth:`accumulating_graph`."""
        result = []
        for k in weights:
            grad = self.weight_grads[k]
            if grad.subclass or len(grad.positions) != 1:
                raise ValueError(f"fxsplit: {self.name}: weight {k}'s gradient is a tensor subclass")
            result.append(grad.positions[0])
        return tuple(result)

    def weight_gradient_values(self, dw_vals: Sequence[Any]) -> list[Any]:
        """One gradient per :attr:`weight_grads` from the dW graph's outputs
        ``dw_vals``: a plain weight's output as it is, a subclass weight's
        (DTensor) rebuilt from its pieces as AOTAutograd would after the fused
        backward; ``None`` where an output is ``None`` (accumulated in the graph)."""
        if not self._has_subclass_inputs:
            return list(dw_vals)
        flat: list[Any] | None = None
        result: list[Any] = []
        for grad in self.weight_grads:
            if not grad.subclass:
                result.append(dw_vals[grad.positions[0]])
                continue
            if self._subclass_grads is None:
                raise RuntimeError(
                    f"fxsplit: {self.name}: no split backward ran, so its DTensor gradients cannot be built"
                )
            if flat is None:
                flat = self._assemble([None] * len(self.split.di_outputs), dw_vals)
            result.append(self._subclass_grads.gradient(grad.input_index, flat))
        return result

    # -- graph-level pieces -------------------------------------------------
    @property
    def capture(self) -> RegionCapture | None:
        """The region's CUDA graph slots (:mod:`fxsplit.cudagraphs`), once a
        split call decided them; ``None`` when CUDA graphs were not asked for
        or not decided yet. ``capture.status`` says why a region runs uncaptured."""
        return self._capture

    def _decide_capture(self, args: Sequence[Any]) -> RegionCapture | None:
        """On the first split call: whether the region can use CUDA graphs at
        all (said once where not), and its slots if so."""
        self._capture_decided = True
        if not self.cudagraphs:
            self._plain_di = True  # (every later dI runs as it is)
            return None
        # A CPU scalar (an RNG seed saved for backward) is read on the host: it keys the slot by value.
        devices = {a.device for a in args if isinstance(a, torch.Tensor) and not (a.device.type == "cpu" and a.dim() == 0)}
        device = next(iter(devices)) if len(devices) == 1 else torch.device("cpu")
        backend = capture_backend(device)
        notice = getattr(self.graphs, "forward_cudagraphs_notice", None)
        self._tree_notice = notice() if notice is not None else None
        self._capture = RegionCapture(self.name, backend, device)  # type: ignore[arg-type]
        if backend is None:
            where = ", ".join(sorted(str(d) for d in devices)) or "no device"
            self._capture.disable(f"its tensors are on {where}, not one CUDA device")
        elif getattr(self.graphs, "dynamic", False):
            self._capture.disable("it has symbolic sizes")
        return self._capture if self._capture.status == "captured" else None

    def run_dw(
        self,
        live_ins: list[Any],
        timings: dict[str, int] | None = None,
        slot: Slot | None = None,
        graph: ti.BoxedCallable | None = None,
        positions: tuple[int, ...] = (),
    ) -> list[Any]:
        """Run the dW graph on ``live_ins`` (through the slot's CUDA graph where there is
        one) and return its outputs. ``graph``: instead, the variant that adds the gradients
        at ``positions`` into the ``.grad`` tensors ending ``live_ins``
        (:meth:`accumulating_graph`; the caller counts its runs). The time inside goes to
        ``timings["w_graph_ns"]``."""
        # Outside the autograd engine: reproduce the state it runs backward
        # graphs in (no grad mode; the graph is already autocast-lowered).
        grad_mode = torch.is_grad_enabled()
        ti.set_grad_enabled(False)
        try:
            with ti.autocast_disabled():
                t0 = time.perf_counter_ns()
                if slot is not None and self._capture is not None:
                    out = self._capture.run_dw(slot, graph or self._run_dw, live_ins, None if graph is None else positions)
                    if out is None:  # uncaptured on the slot's live-ins
                        out = self._capture.adopt(slot, list((graph or self._run_dw)(live_ins)))
                else:
                    out = list((graph or self._run_dw)(live_ins))
                dt = time.perf_counter_ns() - t0
        finally:
            ti.set_grad_enabled(grad_mode)
        self.graph_ns["dW"] += dt
        if timings is not None:
            timings["w_graph_ns"] += dt
        self.stats["dw_runs"] += 1
        return out

    @property
    def boundary(self) -> BoundaryGuard:
        """The check between the dI graph and its consumers; ``boundary.adapted``
        lists every output that came back in another layout and what was done."""
        guard = self._boundary
        if guard is None:
            self._graph("dW")  # the live-ins are checked against what dW was compiled for
            guard = self._boundary = BoundaryGuard(self.name, *self.graphs.di_boundary())
        return guard

    def _di_and_live(
        self, args: list[Any], timings: dict[str, int] | None = None
    ) -> tuple[list[Any], list[Any], Slot | None]:
        """Run dI: its outputs, the live-ins, and the CUDA graph slot holding
        the live-ins (``None`` uncaptured), which the caller hands to the W
        work (or releases)."""
        guard = self._boundary or self.boundary
        if self._plain_di:  # (as decided on the first call: no CUDA graphs, no trees to tell)
            t0 = time.perf_counter_ns()
            outs, slot = list(self._run_di(args)), None
            dt = time.perf_counter_ns() - t0
        else:
            capture = self._capture if self._capture_decided else self._decide_capture(args)
            outs, slot, dt = self._di_with_cudagraphs(capture, args, self._n_di)
        self.graph_ns["dI"] += dt
        if timings is not None:
            timings["b_graph_ns"] += dt
        guard(outs)
        self.stats["di_runs"] += 1
        return outs[:self._n_di], outs[self._n_di:], slot

    def _di_with_cudagraphs(self, capture: RegionCapture | None, args: list[Any], n: int) -> tuple[list[Any], Slot | None, int]:
        """:meth:`_di_and_live`'s dI run where CUDA graphs are on: replayed in
        the region's slot while it is captured, and where the forward runs in
        cudagraph trees, told to them (the live-ins W reads are copied out of
        their memory when dI ran uncaptured); with the nanoseconds inside."""
        notice = self._tree_notice
        if notice is not None:
            notice()  # a backward runs: the trees keep the forwards waiting for one
        t0 = time.perf_counter_ns()
        replayed = None
        if capture is not None and capture.status == "captured":
            replayed = capture.run_di(self._run_di, args, n, self._passthrough, self._tangents)
        if replayed is not None:
            outs, slot = replayed
        else:
            outs, slot = list(self._run_di(args)), None
            if notice is not None:
                for i in self._passthrough:  # out of the trees' memory, for W
                    outs[i] = copy_exactly(outs[i])
        return outs, slot, time.perf_counter_ns() - t0

    def _assemble(self, di_vals: Sequence[Any], dw_vals: Sequence[Any] | None) -> list[Any]:
        """The backward's outputs: ``di_vals`` and ``dw_vals`` (``None``: none
        yet) at their places, ``None`` elsewhere (one C-level pass)."""
        if dw_vals is None:
            return list(map([*di_vals, None].__getitem__, self._di_places))
        return list(map([*di_vals, *dw_vals, None].__getitem__, self._places))

    def _full(self, args: list[Any]) -> list[Any]:
        if self.fused_backward:
            t0 = time.perf_counter_ns()
            out = list(self._run_fused(args))  # type: ignore[misc]
            self.graph_ns["fused"] += time.perf_counter_ns() - t0
            self.stats["fused_runs"] += 1
            return out
        di_vals, live, slot = self._di_and_live(args)
        args.clear()
        try:
            dw_vals = self.run_dw(live, slot=slot)
        finally:
            if slot is not None:
                slot.release()
        return self._assemble(di_vals, dw_vals)

    # -- AOTAutograd entry point -------------------------------------------
    def __call__(self, args: list[Any]) -> list[Any]:
        node = ti.current_autograd_node()
        if node is None:
            node = getattr(_direct, "node", None)
        call = getattr(node, _CALL_ATTR, None) if node is not None else None
        if call is None:
            return self._full(args)
        if torch.is_grad_enabled():
            raise NotImplementedError(
                "fxsplit: create_graph=True / double backward through a split backward is not supported"
            )
        if call is SPLIT_DONE:
            args.clear()
            return [None] * self.split.num_outputs
        probe = getattr(_direct, "probe", None)
        if probe is None or probe.node is not node:
            return self._input_only(call, node, args)
        probe.read(self, args)
        probe.result = self._input_only(call, node, args)
        return probe.result

    def run_unwrapped(self, call: InputCall, node: Any, args: list[Any]) -> tuple[Any, ...]:
        """B's call (``call``) of this region's backward for ``node``, on the
        arguments AOTAutograd's wrapper would pass (:class:`AotCall`; grad
        mode is off, as its guard checks)."""
        self.unwrapped_b_runs += 1
        return tuple(self._input_only(call, node, args))

    def _input_only(self, call: InputCall, node: Any, args: list[Any]) -> list[Any]:
        # The plan's reading of the node's edges, where B's plan made one.
        children = call.plan.region_children.get(node)
        edges = node.next_functions if children is None else None
        if len(edges if children is None else children) != self._num_edges:
            self.layout.edges_by_input(node.next_functions, self.name)  # raises, naming the mismatch
        if self._subclass_grads is None and self._has_subclass_inputs:
            self._subclass_grads = ti.SubclassGradients.of(node)
        if call.release_first and node not in call.plan.rerun:
            ti.release_region_saved(node)  # ``args`` holds them now: dI frees each after its last use
            self.direct_b_runs += call.direct  # (a direct call's plan re-runs nothing)
        else:  # as AOTAutograd's wrapper does: under an engine call that frees the graph, ``args`` holds them
            node.maybe_clear_saved_tensors()  # (else a no-op, as a second call after the wrapper's)
        di_vals, live, slot = self._di_and_live(args, call.timings)
        args.clear()
        try:
            return self._record(call, node, edges, children, di_vals, live, slot)
        except BaseException:
            if slot is not None:
                slot.release_if_untaken()  # B failed before its W work took the slot over
            raise

    def _record(
        self,
        call: InputCall,
        node: Any,
        edges: Sequence[Any] | None,
        children: Sequence[Any] | None,
        di_vals: list[Any],
        live: list[Any],
        slot: Slot | None,
    ) -> list[Any]:
        """Record the W work of ``node`` for ``call`` and return the backward's
        outputs B hands on. ``edges``: the node's ``next_functions``, or ``None``
        where the plan read them as ``children`` (their nodes) and found the
        parameters (``call.plan.region_params``)."""
        found = call.plan.region_params.get(node)  # (the plan reads both for a node, or neither)
        if children is not None and self._every_weight_edge and not any(
            map(operator.is_, params := list(map(found.__getitem__, self._weight_edges)), _NONES)
        ):  # every weight gradient's weight was given to B (the common case)
            accumulators = list(map(children.__getitem__, self._weight_edges))
        elif children is not None:
            params = [found[j] if j is not None else None for j in self._weight_edges]
            accumulators = [children[j] if p is not None else None for j, p in zip(self._weight_edges, params)]
        else:
            params, accumulators = self._params_of(edges, call.weight_ids)
        b_storages = ti.storage_ptrs([*di_vals, *map(live.__getitem__, self.passthrough_at)])  # (see held_elsewhere)
        call.compiled.append(CompiledWeightWork(self, live, params, accumulators, slot, b_storages))
        result = self._assemble(di_vals, None)
        # Input gradients this B call does not use may be needed by W's eager
        # part (an eager weight upstream of this region): hand them to it.
        if node not in call.plan.region_starts:
            return result
        handed: set[int] = set()
        edges = self.layout.edges_by_output(edges if edges is not None else node.next_functions, self.name)
        for i in self.split.di_outputs:
            owner = self.layout.owners[i]
            fn, input_nr = edges[i] if edges[i] is not None else (None, 0)
            if owner is None or owner in handed or result[i] is None or fn is None or ti.engine_will_execute(fn):
                continue
            handed.add(owner)
            value = result[i]
            if owner in self.layout.subclass_inputs and self._subclass_grads is not None:
                value = self._subclass_grads.gradient(owner, result)
            if value is not None:
                call.deferred.append(DeferredGrad(node, fn, input_nr, value))
        return result

    def _params_of(self, edges: Sequence[Any], wanted: frozenset[int]) -> tuple[list[torch.Tensor | None], list[Any]]:
        """The parameter behind each weight's gradient (:attr:`weight_grads`),
        if it was given to B, and its grad accumulator. ``edges``: the region's
        autograd node's ``next_functions``."""
        params: list[torch.Tensor | None] = []
        accumulators: list[Any] = []
        accumulate_grad = ti.accumulate_grad_type()
        parameter = torch.nn.Parameter
        for j in self._weight_edges:
            fn = edges[j][0] if j is not None else None
            var = fn.variable if type(fn) is accumulate_grad else None
            if id(var) in wanted and isinstance(var, parameter):
                params.append(var)
                accumulators.append(fn)
            else:
                params.append(None)
                accumulators.append(None)
        return params, accumulators
