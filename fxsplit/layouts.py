"""Where two compiled graphs meet: what one returns is made what the next was compiled for.

Inductor may return, for an output of a compiled graph, any tensor that is
numerically the value the FX graph describes: another rank (torch 2.11's
mix-order reduction on CUDA returns a keep-dim ``sum`` of shape ``(1, n)`` as
``(n,)``), other strides, a storage offset, a view of a larger buffer. Code
compiled for the FX value (the dW graph's ``assert_size_stride`` on its
inputs, a ``view`` in an uncompiled graph) then fails or, uncompiled,
computes on the wrong shape.

:class:`BoundaryGuard` checks, on every call, each tensor that crosses from
the dI graph (its input-gradient outputs, which autograd receives, and the
live-ins the dW graph receives) against the layout its consumer expects, and
conforms what differs: a view where one exists (another rank), else one copy
into the expected layout (other strides, another dtype). The check is two
tuple comparisons per tensor; nothing happens at W. Each conformed boundary
is reported once per region (log, INFO) and listed in
:attr:`BoundaryGuard.adapted`, so a layout fxsplit had to repair is never
silent.

Expected layouts come from the values the consumer was compiled for (fake
tensors of the traced graph, with symbolic sizes where the region is
dynamic). Static sizes are compared exactly (strides of size-1 dimensions are
ignored, as Inductor's ``assert_size_stride`` ignores them). Symbolic ones
are evaluated at the call's values of their symbols, read off what crosses
the same boundary (a size the consumer receives as an integer, or a
dimension of a tensor compiled for exactly that symbol), and then compared
exactly too: a consumer compiled for a slice of a wider buffer (stride
``8*s1`` for a dimension of size ``s1``) asserts that stride, which a dense
tensor of the same values does not have. Where a symbol cannot be read off,
what the layout fixes regardless is checked: the rank, the dimensions
statically of size 1, the broadcast dimensions (stride 0: an expand the
consumer was compiled to read as one), and for the other strides, density in
the expected dimension order.
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch

from fxsplit import _torch_internals as ti

log = logging.getLogger("fxsplit")

__all__ = ["BoundaryGuard", "LayoutMismatch", "TensorLayout"]


class LayoutMismatch(RuntimeError):
    """A tensor crossing between two compiled graphs cannot be made what its
    consumer was compiled for (another number of elements, another device)."""


def _static(value: Any) -> int | None:
    """``value`` as an int where it is one (a plain int, or a SymInt with a
    constant expression), else ``None``."""
    if isinstance(value, int):
        return value
    if isinstance(value, torch.SymInt):
        expr = value.node.expr
        if getattr(expr, "is_number", False):
            return int(expr)
    return None


def _expr(value: Any) -> Any:
    """A size or stride as an int, or as the sympy expression of a SymInt."""
    return value.node.expr if isinstance(value, torch.SymInt) else int(value)


def _symbol(value: Any) -> Any:
    """The symbol ``value`` is exactly (a SymInt whose expression is one
    symbol), else ``None``."""
    if isinstance(value, torch.SymInt):
        expr = value.node.expr
        if getattr(expr, "is_Symbol", False):
            return expr
    return None


def _evaluator(exprs: Sequence[Any]) -> tuple[tuple[str, ...], Callable[..., tuple[int, ...]]] | None:
    """The names of the symbols of ``exprs`` (ints and sympy expressions) and
    a Python function of their values returning the values of ``exprs``,
    where every expression is built of integers and symbols by sums,
    products and powers (a size or stride in Inductor's terms); else
    ``None``. A call costs a tuple of integer operations."""
    symbols: set[Any] = set()
    for e in exprs:
        if isinstance(e, int):
            continue
        for node in sympy.preorder_traversal(e):
            if node.is_Symbol:
                symbols.add(node)
            elif not (node.is_Integer or node.is_Add or node.is_Mul or (node.is_Pow and node.exp.is_nonnegative)):
                return None
    order = tuple(sorted(map(str, symbols)))
    source = f"lambda {', '.join(order)}: ({', '.join(map(str, exprs))},)"
    return order, eval(source, {"__builtins__": {}})  # noqa: S307 - sympy's printing of the expressions above


def _hint(value: Any) -> int:
    """An example value of a size (its hint when symbolic)."""
    if isinstance(value, torch.SymInt):
        hint = getattr(value.node, "hint", None)  # SymNode.hint: torch 2.11 to 2.15
        return int(hint) if isinstance(hint, int) else 2
    return int(value)


class TensorLayout:
    """The layout a consumer was compiled for, from its example ``value``.

    ``size`` and ``stride`` are tuples of ints when every size and stride is
    static (``static``); otherwise ``rank``, ``ones`` (dimensions statically
    of size 1) and ``order`` (dimensions from the smallest stride to the
    largest, at the example's sizes) describe it, and ``exprs`` (the sizes'
    and strides' expressions) evaluates to its exact sizes and strides given
    its symbols' values (:meth:`exact`).
    """

    __slots__ = ("rank", "dtype", "device", "static", "size", "stride", "ones", "order", "strides", "zeros", "exprs",
                 "_evaluate")

    def __init__(self, value: torch.Tensor, strides: bool = True) -> None:
        # strides=False: only the shape and dtype matter to the consumer (autograd
        # takes an input gradient of any strides).
        self.strides = strides
        self.rank = value.dim()
        self.dtype = value.dtype
        self.device = value.device
        sizes = [_static(s) for s in value.shape]
        strides = [_static(s) for s in value.stride()]
        self.static = all(s is not None for s in sizes + strides)
        self.size: tuple[int, ...] = tuple(s if s is not None else -1 for s in sizes)
        self.stride: tuple[int, ...] = tuple(s if s is not None else -1 for s in strides)
        self.ones = tuple(k for k, s in enumerate(sizes) if s == 1)
        # Broadcast dimensions (an expand: stride 0, size not 1). A consumer compiled
        # for one reads index 0 along it; what crosses must be laid out so too.
        self.zeros = tuple(k for k, (n, st) in enumerate(zip(sizes, strides)) if st == 0 and n != 1)
        hints = [_hint(s) for s in value.stride()]
        self.order = tuple(k for k in sorted(range(self.rank), key=lambda k: (hints[k], k)) if k not in self.zeros)
        self.exprs: tuple[tuple[Any, ...], tuple[Any, ...]] | None = None if self.static else (
            tuple(map(_expr, value.shape)), tuple(map(_expr, value.stride())))
        self._evaluate = None if self.exprs is None else _evaluator(self.exprs[0] + self.exprs[1])

    def exact(self, env: dict[str, int] | None) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """The sizes and strides expected, given ``env`` (a symbol's name ->
        its value), or ``None`` where a symbol of them has no value there."""
        if self.exprs is None or not env:
            return None
        try:
            if self._evaluate is not None:
                names, evaluate = self._evaluate
                values = evaluate(*map(env.__getitem__, names))
            else:  # (an expression of other functions: sympy evaluates it)
                values = tuple(e if type(e) is int else int(e.xreplace({x: env[str(x)] for x in e.free_symbols}))
                               for e in self.exprs[0] + self.exprs[1])
        except (KeyError, TypeError):  # a symbol env has no value for
            return None
        return values[:self.rank], values[self.rank:]

    def matches(self, t: torch.Tensor, env: dict[str, int] | None = None) -> bool:
        """Whether ``t`` is laid out as expected (the per-call check); ``env``:
        the call's values of the layout's symbols, where known."""
        return self._matches(t, self._known(env))

    def _known(self, env: dict[str, int] | None) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """The exact sizes and strides expected: static, or :meth:`exact` at ``env``."""
        return (self.size, self.stride) if self.static else self.exact(env)

    def _matches(self, t: torch.Tensor, exact: tuple[tuple[int, ...], tuple[int, ...]] | None) -> bool:
        if t.dtype != self.dtype:
            return False
        if exact is not None:
            size, expected = exact
            if t.shape != size:
                return False
            if not self.strides:
                return True
            stride = t.stride()
            return stride == expected or all(a == b for a, b, n in zip(stride, expected, size) if n != 1)
        if t.dim() != self.rank or any(t.shape[k] != 1 for k in self.ones):
            return False
        if not self.strides:
            return True
        if self.zeros and any(t.stride(k) != 0 and t.shape[k] != 1 for k in self.zeros):
            return False
        return self._dense_in_order(t)

    def _dense_in_order(self, t: torch.Tensor) -> bool:
        expected = 1
        for k in self.order:
            n = t.shape[k]
            if n != 1 and t.stride(k) != expected:
                return False
            expected *= n
        return True

    def _size_for(self, t: torch.Tensor, exact: tuple[tuple[int, ...], tuple[int, ...]] | None) -> tuple[int, ...]:
        """The expected size: ``exact``'s, else at ``t``'s sizes where it is symbolic."""
        if exact is not None:
            return exact[0]
        if t.dim() == self.rank:
            return tuple(t.shape)
        unknown = [k for k, n in enumerate(self.size) if n < 0]
        known = math.prod(n for n in self.size if n >= 0)
        if len(unknown) == 1 and known and t.numel() % known == 0:
            # One symbolic size: the number of elements fixes it.
            return tuple(t.numel() // known if n < 0 else n for n in self.size)
        # Another rank: keep t's dimensions that are not 1, put 1 where the
        # expected layout has a static 1 (a keep-dim reduction returned without it).
        rest = [n for n in t.shape if n != 1]
        free = self.rank - len(self.ones)
        if len(rest) != free:
            raise LayoutMismatch(
                f"cannot give a tensor of shape {tuple(t.shape)} the rank {self.rank} expected "
                f"(sizes {['?' if n < 0 else n for n in self.size]})"
            )
        it = iter(rest)
        return tuple(1 if k in self.ones else next(it) for k in range(self.rank))

    def _stride_for(self, size: tuple[int, ...], exact: tuple[tuple[int, ...], tuple[int, ...]] | None) -> tuple[int, ...]:
        """The expected strides: ``exact``'s, else dense in the expected order at ``size``."""
        if exact is not None:
            return exact[1]
        stride = [0] * self.rank  # (0 along the broadcast dimensions, which order leaves out)
        expected = 1
        for k in self.order:
            stride[k] = expected
            expected *= size[k]
        return tuple(stride)

    def conform(self, t: torch.Tensor, env: dict[str, int] | None = None) -> tuple[torch.Tensor, str]:
        """``t`` laid out as expected (``env``: as in :meth:`matches`), and what
        was done (``"view"`` or ``"copy"``).

        Raises :class:`LayoutMismatch` where ``t`` holds another number of
        elements or lives on another device."""
        if t.device != self.device and not (t.device.type == self.device.type == "meta"):
            raise LayoutMismatch(f"a tensor on {t.device} where {self.device} was expected")
        exact = self._known(env)
        size = self._size_for(t, exact)
        if t.numel() != math.prod(size):
            raise LayoutMismatch(f"a tensor of shape {tuple(t.shape)} where shape {size} was expected")
        how = "view"
        if t.dtype != self.dtype:
            t = t.to(self.dtype)
            how = "copy"
        if tuple(t.shape) != size:
            try:
                t = t.view(size)
            except RuntimeError:
                t = t.reshape(size)
                how = "copy"
        if not self._matches(t, exact):
            out = torch.empty_strided(size, self._stride_for(size, exact), dtype=self.dtype, device=t.device)
            # Along a broadcast dimension every element of out is one memory location:
            # copy index 0 of t there (t is numerically the expanded value).
            dst, src = out, t
            for k in self.zeros:
                dst, src = dst.narrow(k, 0, 1), src.narrow(k, 0, 1)
            dst.copy_(src)
            t = out
            how = "copy"
        return t, how

    def __repr__(self) -> str:
        if self.static:
            return f"{self.dtype} size {self.size} stride {self.stride}"
        sizes = ", ".join("?" if n < 0 else str(n) for n in self.size)
        broadcast = f", broadcast along {list(self.zeros)}" if self.zeros else ""
        return f"{self.dtype} size ({sizes}) dense in dimension order {list(self.order)}{broadcast}"


# Metadata guards a BoundaryGuard makes before it checks every call in Python.
_MAX_GUARDS = 8


def _describe(t: torch.Tensor) -> str:
    return f"{t.dtype} size {tuple(t.shape)} stride {tuple(t.stride())} offset {t.storage_offset()}"


class BoundaryGuard:
    """Checks and conforms the tensors one compiled graph hands another.

    ``expected[i]`` is the example value (a tensor) the consumer of position
    ``i`` of the producer's output list was compiled for, or ``None`` for a
    position not to check; ``names[i]`` names it in reports; ``strides[i]``
    says whether its strides matter (``False``: shape and dtype only).
    ``region`` names the region in logs. A symbolic size (a SymInt) at a
    position is not checked; it tells where the call's value of its symbol
    is, as does each dimension of a checked tensor compiled for one symbol.
    """

    __slots__ = ("region", "_checks", "_exact", "adapted", "_reported", "_fast", "_pick", "_fast_state", "_guards_made",
                 "_symbols")

    def __init__(
        self, region: str, expected: Sequence[Any], names: Sequence[str], strides: Sequence[bool] | None = None
    ) -> None:
        self.region = region
        self._checks: tuple[tuple[int, str, TensorLayout], ...] = tuple(
            (i, names[i], TensorLayout(v, True if strides is None else strides[i]))
            for i, v in enumerate(expected)
            if isinstance(v, torch.Tensor)
        )
        # The per-call check, as plain tuples: (position, size, stride or None, dtype).
        # A tensor that matches them exactly needs no closer look.
        self._exact = tuple(
            (i, layout.size, layout.stride if layout.strides else None, layout.dtype, k)
            for k, (i, _, layout) in enumerate(self._checks)
        )
        # A symbol's name -> where the call's value of it is: (position, None, 0), the
        # integer there; (position, k, rank), dimension k of the tensor there, read
        # only where that tensor has the rank it was compiled for. Integers first:
        # they are the values the consumer receives.
        self._symbols: dict[str, tuple[int, int | None, int]] = {}
        for i, v in enumerate(expected):
            if (symbol := _symbol(v)) is not None:
                self._symbols.setdefault(str(symbol), (i, None, 0))
        for i, _, layout in self._checks:
            for k, size in enumerate(expected[i].shape):
                if (symbol := _symbol(size)) is not None:
                    self._symbols.setdefault(str(symbol), (i, k, layout.rank))
        # name -> what was found and what was done, for inspection (first occurrence).
        self.adapted: dict[str, str] = {}
        self._reported: set[str] = set()
        # After a call whose values all passed as they came (exactly as compiled
        # for, or in a layout the consumer accepts: nothing conformed): one C call
        # that passes values with exactly their metadata, which the checks below
        # read nothing else of (a graph with static shapes returns the same
        # layouts every call). A miss checks that call in Python and guards its
        # metadata instead, up to _MAX_GUARDS times; then the Python check decides
        # every call (a producer whose layouts keep changing).
        positions = tuple(i for i, *_ in self._exact)
        self._pick = operator.itemgetter(*positions) if len(positions) > 1 else None
        self._fast: Callable[..., bool] | None = None
        self._fast_state = "untried" if positions else "off"
        self._guards_made = 0

    def __call__(self, values: list[Any]) -> list[Any]:
        """Conform ``values`` in place (and return them)."""
        fast = self._fast
        if fast is not None:
            if fast(*self._pick(values)):  # type: ignore[misc]
                return values
            self._fast = None
            self._fast_state = "untried" if self._guards_made < _MAX_GUARDS else "off"
        conformed = False
        env: dict[str, int] | None = None
        for i, size, stride, dtype, k in self._exact:
            t = values[i]
            if (
                t.__class__ is torch.Tensor
                and t.shape == size
                and (stride is None or t.stride() == stride)
                and t.dtype is dtype
            ):
                continue
            if t.__class__ is not torch.Tensor:
                conformed = True  # (a subclass or no tensor: checked every call, never guarded)
            _, name, layout = self._checks[k]
            if env is None and not layout.static:
                env = self._env(values)
            if isinstance(t, torch.Tensor) and not layout.matches(t, env):
                values[i] = self._conform(name, layout, t, env)
                conformed = True
        if not conformed and self._fast_state == "untried" and self._pick is not None:
            self._guards_made += 1
            self._fast = ti.metadata_guard(list(self._pick(values)))
            self._fast_state = "on" if self._fast is not None else "off"
        return values

    def _env(self, values: list[Any]) -> dict[str, int]:
        """The call's value of each symbol (by name) that can be read off ``values``."""
        env: dict[str, int] = {}
        for symbol, (i, k, rank) in self._symbols.items():
            v = values[i]
            if k is None and isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool):
                env[symbol] = int(v)
            elif k is not None and isinstance(v, torch.Tensor) and v.dim() == rank:
                env[symbol] = v.shape[k]
        return env

    def _conform(self, name: str, layout: TensorLayout, t: torch.Tensor, env: dict[str, int] | None = None) -> torch.Tensor:
        try:
            out, how = layout.conform(t, env)
        except LayoutMismatch as e:
            raise LayoutMismatch(
                f"fxsplit: {self.region}: {name} came back from the compiled dI graph as {_describe(t)}, "
                f"and the graph it goes to was compiled for {layout}: {e}"
            ) from None
        if name not in self._reported:
            self._reported.add(name)
            self.adapted[name] = f"{_describe(t)} -> {_describe(out)} ({how})"
            log.info(
                "fxsplit: %s: %s came back from the compiled dI graph as %s, not as %s; conformed by a %s "
                "on every call (a view costs nothing; see docs/troubleshooting.md)",
                self.region, name, _describe(t), layout, how,
            )
        return out
