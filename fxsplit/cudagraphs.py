"""CUDA graphs for a region's dI and dW graphs (``mode="reduce-overhead"``).

With ``triton.cudagraphs`` on (``torch.compile(..., mode="reduce-overhead")``),
Inductor replays the forward and the fused backward through its cudagraph
trees. fxsplit replays the dI and dW graphs through a capture of its own,
because what crosses between them must outlive any later replay: a
zero-bubble schedule holds the live-ins of several microbatches between
their B and their W, and a replay that wrote into one would change another
microbatch's gradients without a sound.

So each region keeps *slots*. A slot is one captured dI graph and the dW graphs
captured against its outputs, each graph in a private memory pool of its own
(graphs captured into one pool reuse each other's freed blocks, so a dW
output handed out as ``.grad`` could sit where the slot's next dI replay
writes its temporaries). A slot is keyed by
the addresses of dI's inputs (the saved activations, which the forward's own
CUDA graphs or the caching allocator put at the same addresses from step to
step, the output gradients, the weights): dI replays reading them where they
are, no copy. Its live-ins are the slot's own output buffers, which dW reads
where they are, no copy either. A slot is busy from B until its W has
committed (or its pending work is dropped), and B then uses another slot,
capturing one more, up to :data:`MAX_SLOTS`; so no replay ever overwrites a
live-in that a pending W still needs. The input gradients B returns leave a
slot as copies. The weight gradients W hands autograd leave it as they are,
aliases of the dW graph's static output buffers, as Inductor's cudagraph trees
hand out their outputs: no copy on the host, which is most of W's host time
otherwise (a gradient that is a live-in as it is, a bias gradient computed in
dI, is copied by the captured dW graph itself, a kernel inside the replay, so
that nothing handed out lies in memory the slot's dI graph writes).
Before it replays again, the dW graph checks that none of them is still held
(the storage's reference count: a ``.grad`` not yet set to ``None``, a view, a
reference kept by the caller); if one is, that W runs uncaptured and says so
once, so a replay never overwrites a gradient someone holds. Weights whose
``.grad`` W accumulates into in the graph are accumulated inside the captured
dW graph, whose ``.grad`` addresses are part of its key.

A region runs uncaptured, and says so once (INFO), where capture is
impossible or would not pay: tensors not on CUDA, symbolic sizes, a capture
that fails (a CPU operation or synchronization inside the graph), more input
address sets or accumulating variants than the limits. ``describe()`` says
what each region does.

Replaying a captured graph runs the same kernels on the same data as the
uncaptured graph: the gradients are bitwise those of the uncaptured split.

The capture itself goes through a :class:`CaptureBackend` (CUDA's by default),
so that the slot logic can be exercised without a GPU (:class:`SimulatedCapture`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from fxsplit import _torch_internals as ti

log = logging.getLogger("fxsplit")

__all__ = [
    "MAX_GRAD_ADDRESS_SETS", "MAX_SLOTS", "CaptureBackend", "RegionCapture", "SimulatedCapture", "capture_backend",
    "copy_exactly",
]

MAX_SLOTS = 8
"""Slots (microbatches in flight between B and W, or input address sets) per region."""
MAX_GRAD_ADDRESS_SETS = 4
"""Accumulating dW graphs captured per slot: one per set of ``.grad`` addresses it adds into (the
same compiled code, captured again). ``fxsplit.runtime.MAX_ACCUMULATING_LAYOUTS`` bounds the code
compiled per region, one per set of ``.grad`` layouts."""

BoxedFn = Callable[[list[Any]], Any]


class CaptureBackend(Protocol):
    """How graphs are captured and replayed."""

    def pool(self, device: torch.device) -> Any:
        """A fresh private memory pool."""

    def warm_up(self, fn: BoxedFn, args: list[Any], device: torch.device) -> list[Any]:
        """Run ``fn`` once as capture will (lazy initialization out of the way);
        its outputs."""

    def capture(self, fn: BoxedFn, args: list[Any], pool: Any, device: torch.device) -> tuple[Any, list[Any]]:
        """Capture ``fn(args)``; returns a handle and the outputs (static buffers,
        written by every replay)."""

    def replay(self, handle: Any) -> None:
        """Run the captured work again, writing the same outputs."""


class _CudaCapture:
    """``torch.cuda.CUDAGraph`` on one side stream per device, each slot with a
    private pool (``torch.cuda.graph_pool_handle``)."""

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = torch.cuda.Stream(device=index)
        return stream

    def pool(self, device: torch.device) -> Any:
        return torch.cuda.graph_pool_handle()

    def warm_up(self, fn: BoxedFn, args: list[Any], device: torch.device) -> list[Any]:
        stream = self._stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            outs = list(fn(list(args)))
        torch.cuda.current_stream(device).wait_stream(stream)
        return outs

    def capture(self, fn: BoxedFn, args: list[Any], pool: Any, device: torch.device) -> tuple[Any, list[Any]]:
        graph = torch.cuda.CUDAGraph()
        stream = self._stream(device)
        torch.cuda.synchronize(device)
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            outs = list(fn(list(args)))
        torch.cuda.synchronize(device)
        return graph, outs

    def replay(self, handle: Any) -> None:
        handle.replay()


class SimulatedCapture:
    """A stand-in for CUDA graphs on any device, for tests: a "replay" runs
    the function again on the tensors it was captured with and copies the
    results into the captured outputs, in place, as a CUDA graph replay
    writes its static output buffers. A test that keeps an output of an
    earlier replay sees it overwritten exactly where a real replay would."""

    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0

    def pool(self, device: torch.device) -> Any:
        return object()  # a token: which captures would share memory

    def warm_up(self, fn: BoxedFn, args: list[Any], device: torch.device) -> list[Any]:
        return list(fn(list(args)))

    def capture(self, fn: BoxedFn, args: list[Any], pool: Any, device: torch.device) -> tuple[Any, list[Any]]:
        # A capture records, it does not run: work on copies for the output
        # buffers, so that nothing the graph writes in place is written here.
        self.captures += 1
        copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        outs = [_as_captured(o, copies, args) for o in fn(list(copies))]  # (fn clears the list it is given)
        return (fn, list(args), outs, pool), outs

    def replay(self, handle: Any) -> None:
        self.replays += 1
        fn, args, outs, _ = handle
        with torch.no_grad():
            for old, new in zip(outs, fn(list(args))):
                if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
                    old.copy_(new)


def _as_captured(out: Any, copies: Sequence[Any], args: Sequence[Any]) -> Any:
    """A simulated capture's static output for ``out``, computed on ``copies``
    of ``args``: an output in an argument's memory stays in that argument's
    memory (the argument itself, or the same view of it), as in a CUDA graph;
    any other output gets memory of its own."""
    if not isinstance(out, torch.Tensor):
        return out
    ptr = ti.storage_ptr(out)
    for c, a in zip(copies, args):
        if isinstance(c, torch.Tensor) and ti.storage_ptr(c) == ptr:
            if out is c:
                return a
            if a.stride() == c.stride():
                return a.as_strided(out.size(), out.stride(), a.storage_offset() + out.storage_offset() - c.storage_offset())
    return out.clone()


_CUDA = _CudaCapture()


def capture_backend(device: torch.device) -> CaptureBackend | None:
    """The capture for tensors on ``device``, or ``None`` where CUDA graphs do not apply."""
    if device.type == "cuda" and torch.cuda.is_available():
        return _CUDA
    return None


def _ptrs(args: Sequence[Any], copied: frozenset[int] = frozenset()) -> tuple[Any, ...]:
    """Where each tensor argument lies (a CPU scalar by its value: a capture
    reads it on the host), nothing for those copied in: the key of an
    accumulating dW graph's ``.grad`` tensors (a slot's is a :class:`_Key`)."""
    return tuple(
        None if i in copied
        else (("cpu", a.item()) if _is_cpu_scalar(a) else a.data_ptr())
        if isinstance(a, torch.Tensor)
        else a
        for i, a in enumerate(args)
    )


# A C++ check of many tensors' addresses against a list (what Inductor's
# cudagraph trees check their static inputs with); CUDA builds of torch have it.
_PTRS_EQUAL = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


def _is_cpu_scalar(a: Any) -> bool:
    return isinstance(a, torch.Tensor) and a.device.type == "cpu" and a.dim() == 0


def _strided_storage(o: Any) -> int | None:
    """The storage (data pointer) of a strided tensor, else ``None``."""
    return ti.storage_ptr(o) if isinstance(o, torch.Tensor) and o.layout == torch.strided else None


class _Key:
    """The key of a slot (:func:`_ptrs`'s, checked faster): the addresses of
    dI's tensor arguments, checked in one C++ call where torch has it; CPU
    scalars by value and other values as they are; the arguments at
    ``copied`` not at all."""

    __slots__ = ("_idx", "_ptrs", "_rest_idx", "_rest")

    def __init__(self, args: Sequence[Any], copied: frozenset[int]) -> None:
        self._idx = [
            i for i, a in enumerate(args) if i not in copied and isinstance(a, torch.Tensor) and not _is_cpu_scalar(a)
        ]
        at = set(self._idx)
        self._ptrs: list[int | None] = [a.data_ptr() if i in at else None for i, a in enumerate(args)]
        self._rest_idx = [i for i in range(len(args)) if i not in copied and i not in at]
        self._rest = self._values(args)

    def _values(self, args: Sequence[Any]) -> tuple[Any, ...]:
        return tuple(("cpu", args[i].item()) if _is_cpu_scalar(args[i]) else args[i] for i in self._rest_idx)

    def matches(self, args: Sequence[Any]) -> bool:
        if len(args) != len(self._ptrs):
            return False
        if _PTRS_EQUAL is not None:
            same = _PTRS_EQUAL(args, self._ptrs, self._idx)
        else:
            ptrs = self._ptrs
            same = all(args[i].data_ptr() == ptrs[i] for i in self._idx)
        return same and (not self._rest_idx or self._values(args) == self._rest)


class _Graph:
    """One captured graph: its handle, its static outputs, and how each output
    leaves a replay (:meth:`hand_out`).

    An output in memory of the graph's own leaves as an alias of the static
    buffer, as Inductor's cudagraph trees hand out theirs; an output in memory
    the caller gave the graph leaves as a copy (a dW graph copies its
    passed-through live-ins itself, inside the capture: see
    :meth:`RegionCapture.run_dw`). With ``watch``, each of the graph's own
    storages is watched from capture on (:class:`StorageUse`, the static
    outputs being its only holders then), and ``in_use()`` says, before the
    graph replays again, whether one handed out is still held: the replay
    would overwrite it. ``storages``: the data pointers of those storages."""

    __slots__ = ("handle", "outs", "storages", "_how", "_uses", "in_use", "_all_alias")

    def __init__(self, handle: Any, outs: list[Any], inputs: Sequence[Any] = (), watch: bool = True) -> None:
        self.handle = handle
        self.outs = outs
        taken = ti.storage_ptrs(inputs)
        own: dict[int, ti.StorageUse | None] = {}
        how: list[Any] = []
        for o in outs:
            ptr = _strided_storage(o) if type(o) is torch.Tensor else None
            if ptr is not None and ptr not in taken:
                if ptr not in own:
                    own[ptr] = ti.StorageUse(o) if watch else None
                how.append(_ALIAS)
            else:
                how.append(copy_exactly if isinstance(o, torch.Tensor) else None)
        self._how = how
        self._all_alias = all(h is _ALIAS for h in how)
        self.storages = frozenset(own)
        self._uses = [u for u in own.values() if u is not None]
        # in_use(): whether an output handed out by an earlier replay is still
        # held by anyone (a ``.grad``, a view of one, a reference kept across
        # steps). Built once: W asks before every replay.
        self.in_use = ti.StorageUse.any_gained(self._uses)

    def hand_out(self) -> list[Any]:
        """The outputs of the replay just made: aliases of the static buffers
        where this graph owns them, copies of the others."""
        if self._all_alias:  # (the common case: one C-level pass)
            return list(map(_ALIAS, self.outs))
        return [o if how is None else how(o) for o, how in zip(self.outs, self._how)]


def _passed_through(outs: Sequence[Any], args: Sequence[Any]) -> list[int]:
    """Positions of the outputs that lie in one of the arguments' memory."""
    taken = ti.storage_ptrs(args)
    return [i for i, o in enumerate(outs) if _strided_storage(o) in taken]


class Slot:
    """One captured dI graph and the dW graphs captured against its outputs."""

    __slots__ = ("key", "pool", "inputs", "di", "dw", "variants", "holder", "__weakref__")

    def __init__(self, key: _Key, pool: Any) -> None:
        self.key = key
        self.pool = pool  # the dI graph's (each dW graph has its own)
        # dI inputs copied into the slot at every replay (the output gradients,
        # which come from wherever the caller has them): position -> buffer
        self.inputs: dict[int, torch.Tensor] = {}
        self.di: _Graph | None = None
        self.dw: _Graph | None = None
        # (dW output positions accumulated, .grad addresses) -> graph
        self.variants: dict[tuple[Any, ...], _Graph | None] = {}
        # The pending W work holding the slot's live-ins (weak), or None.
        self.holder: Any = None

    @property
    def busy(self) -> bool:
        holder = self.holder() if self.holder is not None else None
        return holder is not None and holder.pending

    def hold(self, owner: Any) -> None:
        self.holder = weakref.ref(owner)

    def release(self) -> None:
        self.holder = None

    def release_if_untaken(self) -> None:
        """Give the slot back if no W work took it over since dI's replay."""
        if self.holder is _TAKEN:
            self.holder = None


def _copying(fn: BoxedFn, positions: Sequence[int]) -> BoxedFn:
    """``fn`` with its outputs at ``positions`` copied (inside a capture: into the pool)."""

    def copying(args: list[Any]) -> list[Any]:
        outs = list(fn(args))
        for i in positions:
            if isinstance(outs[i], torch.Tensor):
                outs[i] = copy_exactly(outs[i])
        return outs

    return copying


def copy_exactly(t: torch.Tensor) -> torch.Tensor:
    """A copy with ``t``'s exact sizes and strides (``clone`` makes a padded
    layout contiguous, which the graph that reads the copy was not compiled for)."""
    expanded = [d for d, (n, st) in enumerate(zip(t.shape, t.stride())) if st == 0 and n > 1]
    if expanded:  # an expanded layout: copy what it holds once, expand the copy alike
        base = t
        for d in expanded:
            base = base.narrow(d, 0, 1)
        return copy_exactly(base).expand(t.shape)
    out = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


def _clone_out(values: Sequence[Any]) -> list[Any]:
    return [copy_exactly(v) if isinstance(v, torch.Tensor) else v for v in values]


_ALIAS = torch.Tensor.detach  # a tensor of its own over the same storage: one more holder


class RegionCapture:
    """The slots of one region (module docs). ``status`` is ``"captured"``, or
    why the region runs uncaptured."""

    def __init__(self, region: str, backend: CaptureBackend, device: torch.device) -> None:
        self.region = region
        self.backend = backend
        self.device = device
        self.slots: list[Slot] = []
        self.status = "captured"
        self._lock = threading.Lock()
        self._said: set[str] = set()
        self.replays = {"dI": 0, "dW": 0, "dW+accumulate": 0}
        # W runs left uncaptured because a gradient an earlier replay handed out was still held
        self.held_back = 0

    def say_once(self, what: str) -> None:
        if what not in self._said:
            self._said.add(what)
            log.info("fxsplit: %s: %s", self.region, what)

    def disable(self, why: str) -> None:
        self.status = why
        self.slots = []
        self.say_once(f"dI and dW run without CUDA graphs: {why}")

    def describe(self) -> str:
        if self.status != "captured":
            return f"CUDA graphs: off ({self.status})"
        busy = sum(s.busy for s in self.slots)
        variants = sum(len([v for v in s.variants.values() if v is not None]) for s in self.slots)
        held = f"; {self.held_back} W run(s) uncaptured, a gradient of an earlier replay still held" if self.held_back else ""
        return (f"CUDA graphs: {len(self.slots)} slot(s) ({busy} holding live-ins), "
                f"{variants} accumulating dW graph(s); replays {self.replays}{held}")

    # -- dI -------------------------------------------------------------------------------------
    def run_di(
        self,
        fn: BoxedFn,
        args: list[Any],
        n_outputs: int,
        copied: Sequence[int] = (),
        copied_inputs: frozenset[int] = frozenset(),
    ) -> tuple[list[Any], Slot | None] | None:
        """Replay (capturing first where needed) the dI graph on ``args``:
        ``(outputs, slot)`` with the first ``n_outputs`` copied out and the
        rest (live-ins) the slot's buffers, or ``None`` when this call must
        run uncaptured. The outputs at ``copied`` (live-ins that are dI's own
        inputs: saved activations, which may live in memory another graph
        replays into) are copied into the slot by the captured graph itself,
        so that W reads the slot only. The inputs at ``copied_inputs`` (the
        output gradients, fresh tensors every microbatch) are copied into the
        slot before each replay instead of keying it."""
        if self.status != "captured":
            return None
        if copied:
            fn = _copying(fn, copied)
        with self._lock:
            slot = next((s for s in self.slots if not s.busy and s.di is not None and s.key.matches(args)), None)
            if slot is None:
                if len(self.slots) >= MAX_SLOTS:
                    self.say_once(
                        f"more than {MAX_SLOTS} microbatches in flight (or input address sets) for its CUDA graphs; "
                        "the others run uncaptured"
                    )
                    return None
                slot = Slot(_Key(args, copied_inputs), self.backend.pool(self.device))
                try:
                    slot.inputs = {i: copy_exactly(args[i]) for i in copied_inputs if isinstance(args[i], torch.Tensor)}
                    static = [slot.inputs.get(i, a) for i, a in enumerate(args)]
                    self.backend.warm_up(fn, static, self.device)
                    handle, outs = self.backend.capture(fn, static, slot.pool, self.device)
                except Exception as e:  # noqa: BLE001 - a capture that cannot be made is reported, not fatal
                    self.disable(f"capturing the dI graph failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
                    return None
                slot.di = _Graph(handle, outs, static, watch=False)
                self.slots.append(slot)
            slot.holder = _TAKEN  # busy until the caller hands it to its W work, or releases it
        for i, buffer in slot.inputs.items():
            buffer.copy_(args[i])
        self.backend.replay(slot.di.handle)  # type: ignore[union-attr]
        self.replays["dI"] += 1
        outs = slot.di.outs  # type: ignore[union-attr]
        return _clone_out(outs[:n_outputs]) + list(outs[n_outputs:]), slot

    # -- dW -------------------------------------------------------------------------------------
    def run_dw(self, slot: Slot, fn: BoxedFn, args: list[Any], positions: tuple[int, ...] | None = None
               ) -> list[Any] | None:
        """Replay the slot's dW graph ``fn`` on ``args`` (capturing it on first use); the
        weight gradients handed out (:class:`_Graph`). ``None``: run uncaptured, also where
        a gradient handed out by the graph's last replay is still held.

        ``positions`` (``None`` for the plain dW graph): ``fn`` is the variant that adds the
        gradients at those dW outputs into the ``.grad`` tensors ending ``args``, captured
        per set of ``.grad`` addresses, at most :data:`MAX_GRAD_ADDRESS_SETS` per slot; one
        replay counts as one write of each in W's ledger (see :mod:`fxsplit.pending`).

        A gradient that is a live-in as it is (a bias gradient computed in dI) is copied by
        the captured graph itself, so that what W hands out is the dW graph's memory, never
        the slot's (which the next dI replay writes)."""
        if self.status != "captured":
            return None
        if positions is None:
            graph, key, n = slot.dw, None, 0
        else:
            n = len(positions)
            key = (positions, _ptrs(args[len(args) - n:]))
            graph = slot.variants.get(key)
        if graph is None:
            if key is not None and (key in slot.variants or len(slot.variants) >= MAX_GRAD_ADDRESS_SETS):
                slot.variants.setdefault(key, None)
                self.say_once(
                    f"more than {MAX_GRAD_ADDRESS_SETS} .grad address sets for its accumulating dW graph; those run "
                    "uncaptured (keep .grad in place: zero_grad(set_to_none=False))"
                )
                return None
            graph = self._capture_dw(fn, args, n)
            if graph is None:
                return None
            if key is None:
                slot.dw = graph
            else:
                slot.variants[key] = graph
        elif graph.in_use():
            return self._held_back()
        if key is None:
            self.backend.replay(graph.handle)
            self.replays["dW"] += 1
            return graph.hand_out()
        # One replay writes every accumulated .grad, or (raising) any of them.
        ledger = ti.current_ledger()
        ptrs = [g.data_ptr() for g in args[len(args) - n:]]
        if ledger is not None:
            ledger.begun.update(ptrs)
        self.backend.replay(graph.handle)
        if ledger is not None:
            ledger.ended.update(ptrs)
        self.replays["dW+accumulate"] += 1
        return graph.hand_out()

    def _capture_dw(self, fn: BoxedFn, args: list[Any], n_grads: int) -> _Graph | None:
        """Capture a dW graph on ``args`` (the last ``n_grads`` the ``.grad`` tensors an
        accumulating variant adds into, warmed up on copies of them); ``None`` if it cannot
        be captured (then the region runs uncaptured, said once)."""
        kind = "accumulating dW" if n_grads else "dW"
        try:
            warm = args if not n_grads else list(args[: len(args) - n_grads]) + [g.clone() for g in args[-n_grads:]]
            passed = _passed_through(self.backend.warm_up(fn, warm, self.device), warm)
            captured = _copying(fn, passed) if passed else fn
            with _no_ledger() if n_grads else contextlib.nullcontext():
                handle, outs = self.backend.capture(captured, args, self.backend.pool(self.device), self.device)
        except Exception as e:  # noqa: BLE001 - a capture that cannot be made is reported, not fatal
            self.disable(f"capturing the {kind} graph failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
            return None
        return _Graph(handle, outs, args)

    def adopt(self, slot: Slot, outs: list[Any]) -> list[Any]:
        """The outputs of a W that ran uncaptured on ``slot``'s live-ins (its
        dW graph's last gradients still held, or no variant to replay), with
        each one that is a live-in itself (a gradient computed in dI, passed
        through) copied, as the captured dW graph copies it: the slot's
        buffer would be overwritten under the caller's ``.grad`` by the next
        dI replay into that slot."""
        di = slot.di
        if di is None:
            return outs
        mine = di.storages
        return [copy_exactly(o) if _strided_storage(o) in mine else o for o in outs]

    def _held_back(self) -> None:
        self.held_back += 1
        self.say_once(
            "a weight gradient from an earlier replay of a dW graph is still referenced (a .grad kept across "
            "steps, or a reference to one): W runs uncaptured until it is dropped, so that the replay cannot "
            "overwrite it"
        )


class _Taken:
    """Marks a slot taken between dI's replay and the W work that holds it
    (``Slot.hold``) or the caller that gives it back (``Slot.release``)."""

    pending = True


_TAKEN_MARK = _Taken()


def _taken() -> _Taken:
    return _TAKEN_MARK


_TAKEN = _taken  # called like a weak reference: Slot.busy reads holder()


@contextlib.contextmanager
def _no_ledger() -> Any:
    """Capture records the accumulation brackets' Python calls, which a
    replay does not make: keep them out of the ledger of the W being run
    (the caller accounts for a replay as one write of every accumulated weight)."""
    with ti.recording_accumulation():
        yield
