"""Space trees: the values of a gymnasium space, an array or a dict of them, handled as one.

An observation (or action) is either a leaf (an array, a tensor, a number) or a ``dict`` of
such trees, as a ``gymnasium.spaces.Dict`` produces. The runtime copies, checks, batches,
stores and moves them in a few shapes; each is one function here, in the spirit of
``gymnasium.vector.utils`` (which dispatches over spaces) but over values, so they work
without the space at hand. Dispatch is a plain ``isinstance(x, dict)``: several of these run
on every env step, where ``functools.singledispatch`` would cost more than the work.

    >>> import numpy as np
    >>> obs = [{"pos": np.zeros(2), "img": np.ones((1, 1))} for _ in range(3)]
    >>> batch = stack(obs)
    >>> batch["pos"].shape, batch["img"].shape
    ((3, 2), (3, 1, 1))
    >>> unstack(batch, 3)[1]["pos"]
    array([0., 0.])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """``fn`` applied to every leaf of ``tree`` (and the matching leaves of ``rest``, trees of the
    same keys), in a tree of the same keys.

        >>> import numpy as np
        >>> tree_map(lambda a: a * 2, {"a": np.ones(2), "b": {"c": 3}})
        {'a': array([2., 2.]), 'b': {'c': 6}}
        >>> tree_map(lambda a, b: a + b, np.ones(2), np.ones(2))
        array([2., 2.])
    """
    if isinstance(tree, dict):
        return {k: tree_map(fn, v, *(r[k] for r in rest)) for k, v in tree.items()}
    return fn(tree, *rest)


def copy_tree(x: Any) -> Any:
    """A copy that owns its memory: some envs return the same array every step and write into it,
    and the runtime keeps each observation until its transition is recorded.

        >>> a = np.zeros(2)
        >>> b = copy_tree({"a": a})
        >>> a[0] = 1.0
        >>> b["a"]
        array([0., 0.])
    """
    if isinstance(x, dict):
        return {k: copy_tree(v) for k, v in x.items()}
    return np.array(x, copy=True)


def all_finite(x: Any) -> bool:
    """No NaN or inf anywhere in ``x`` (integer and boolean leaves always pass).

        >>> all_finite({"a": np.ones(2), "b": np.arange(3)})
        True
        >>> all_finite({"a": np.array([0.0, np.nan])})
        False
    """
    if isinstance(x, dict):
        return all(all_finite(v) for v in x.values())
    a = np.asarray(x)
    return a.dtype.kind not in "fc" or bool(np.isfinite(a).all())


def finite_rows(batch: Any, n: int) -> np.ndarray:
    """For a batch of ``n`` rows, which rows are free of NaN and inf, as a bool array ``[n]``.

        >>> finite_rows({"a": np.array([[0.0, 1.0], [np.inf, 0.0]]), "b": np.zeros((2, 3), int)}, 2)
        array([ True, False])
    """
    if isinstance(batch, dict):
        ok = np.ones(n, bool)
        for v in batch.values():
            ok &= finite_rows(v, n)
        return ok
    a = np.asarray(batch)
    if a.dtype.kind not in "fc":
        return np.ones(n, bool)
    return np.isfinite(a.reshape(n, -1)).all(axis=1)


def stack(xs: list[Any]) -> Any:
    """One batch (a new leading axis) from a list of trees of the same keys.

        >>> stack([{"a": np.zeros(2)}, {"a": np.ones(2)}])["a"].shape
        (2, 2)
        >>> stack([np.zeros(2), np.ones(2)]).shape
        (2, 2)
    """
    first = xs[0]
    if isinstance(first, dict):
        return {k: stack([x[k] for x in xs]) for k in first}
    return np.stack(xs)


def concat(batches: list[Any]) -> Any:
    """One batch from several batches of the same keys (rows one after another).

        >>> concat([{"a": np.zeros((2, 3))}, {"a": np.ones((1, 3))}])["a"].shape
        (3, 3)
    """
    first = batches[0]
    if isinstance(first, dict):
        return {k: concat([b[k] for b in batches]) for k in first}
    return np.concatenate(batches)


def unstack(batch: Any, n: int) -> list[Any]:
    """The ``n`` rows of a batch, as a list of trees (views, not copies); the inverse of :func:`stack`.

        >>> rows = unstack({"a": np.arange(4).reshape(2, 2)}, 2)
        >>> rows[1]
        {'a': array([2, 3])}
    """
    if isinstance(batch, dict):
        cols = {k: unstack(v, n) for k, v in batch.items()}
        return [{k: col[i] for k, col in cols.items()} for i in range(n)]
    return list(batch)


def index(x: Any, i: Any) -> Any:
    """``x[i]`` on every leaf (an int, a slice, ``None`` for a new axis ...).

        >>> index({"a": np.arange(6).reshape(3, 2)}, slice(0, 0))["a"].shape
        (0, 2)
        >>> index({"a": np.arange(3), "b": {"c": np.arange(3) * 2}}, [0, 2])
        {'a': array([0, 2]), 'b': {'c': array([0, 4])}}
    """
    if isinstance(x, dict):
        return {k: index(v, i) for k, v in x.items()}
    return x[i]


def part(x: Any, lo: int, hi: int, n: int) -> Any:
    """Rows ``lo:hi`` of a batch of ``n`` rows: ``x`` itself when that is all of them (no tree walk).

        >>> part(np.arange(4), 1, 3, 4), part(np.arange(4), 0, 4, 4)
        (array([1, 2]), array([0, 1, 2, 3]))
    """
    return x if lo == 0 and hi == n else index(x, slice(lo, hi))


def batch_of_one(x: Any) -> Any:
    """A batch of one row: every leaf as an array with a new leading axis of size 1.

        >>> batch_of_one({"a": np.zeros(2), "b": 3.0})
        {'a': array([[0., 0.]]), 'b': array([3.])}
    """
    if isinstance(x, dict):
        return {k: batch_of_one(v) for k, v in x.items()}
    return np.asarray(x)[None]


def batch_size(x: Any) -> int:
    """The number of rows of a batch (the leading axis of its first leaf).

        >>> batch_size({"a": np.zeros((5, 2)), "b": np.zeros(5)}), batch_size(np.zeros((3, 4)))
        (5, 3)
    """
    while isinstance(x, dict):
        x = next(iter(x.values()))
    return len(x)


def empty_like(x: Any, n: int) -> Any:
    """Uninitialised storage for ``n`` values shaped like the tree ``x``: leaves ``[n, *x.shape]``.

        >>> buf = empty_like({"a": np.zeros(2, np.float32), "b": 1}, 4)
        >>> buf["a"].shape, buf["a"].dtype, buf["b"].shape
        ((4, 2), dtype('float32'), (4,))
    """
    if isinstance(x, dict):
        return {k: empty_like(v, n) for k, v in x.items()}
    x = np.asarray(x)
    return np.empty((n, *x.shape), dtype=x.dtype)


def write(buf: Any, t: int, x: Any) -> None:
    """``buf[t] = x`` on every leaf: store one value in storage made by :func:`empty_like`.

        >>> buf = empty_like({"a": np.zeros(2)}, 3)
        >>> write(buf, 1, {"a": np.ones(2)})
        >>> buf["a"][1]
        array([1., 1.])
    """
    if isinstance(buf, dict):
        for k, v in buf.items():
            write(v, t, x[k])
    else:
        buf[t] = x
