"""A replay buffer for off-policy algorithms: a ring of transitions in memory or on disk, and
demonstrations loaded into one.

A transition is ``(obs, actions, rewards, discounts, next_obs)`` (:mod:`ebrl.algos.transitions`
makes them, n-step returns included): observations are tensors or (nested) dicts of them, kept
in their own dtypes (cameras ``uint8``, an ``instruction`` index ``int64``), actions of any
shape (a chunk ``[K, A]`` too). The storage is allocated at the first :meth:`ReplayBuffer.add`,
one array per leaf, in memory or, with ``directory``, as ``.npy`` memory maps there (the OS
pages them; a long run's buffer need not fit in RAM). ``stored`` counts every transition added,
``evicted`` those overwritten once the ring was full: ``stored == len(buffer) + evicted``.

RLPD samples each minibatch half from demonstrations and half from online data
(:func:`sample_mixed`); :func:`load_demos` reads a LeRobot dataset into a buffer of its own.

    >>> import numpy as np, torch
    >>> buf = ReplayBuffer(capacity=4)
    >>> buf.add({"obs": {"pixels": torch.zeros(6, 8, 8, 3, dtype=torch.uint8), "state": torch.ones(6, 2)},
    ...          "actions": torch.zeros(6, 2), "rewards": torch.arange(6.0), "discounts": torch.ones(6),
    ...          "next_obs": {"pixels": torch.zeros(6, 8, 8, 3, dtype=torch.uint8), "state": torch.ones(6, 2)}})
    6
    >>> buf.counters()
    {'replay_stored': 6, 'replay_size': 4, 'replay_evicted': 2}
    >>> mb = buf.sample(3, np.random.default_rng(0))
    >>> mb["obs"]["pixels"].dtype, mb["obs"]["state"].shape, sorted(mb["rewards"].tolist())[0] >= 2.0
    (torch.uint8, torch.Size([3, 2]), True)
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

FIELDS = ("obs", "actions", "rewards", "discounts", "next_obs")
Key = tuple[str, ...]  # (field, *path inside a dict observation)


def _flatten(field: str, x: Any, path: Key = ()) -> dict[Key, np.ndarray]:
    if isinstance(x, dict):
        out: dict[Key, np.ndarray] = {}
        for k, v in x.items():
            out.update(_flatten(field, v, (*path, str(k))))
        return out
    return {(field, *path): x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)}


def _unflatten(leaves: dict[Key, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, v in leaves.items():
        if len(key) == 1:
            out[key[0]] = v
            continue
        node = out.setdefault(key[0], {})
        for k in key[1:-1]:
            node = node.setdefault(k, {})
        node[key[-1]] = v
    return out


class ReplayBuffer:
    """A ring of ``capacity`` transitions (module docstring); ``directory``: memory-mapped
    ``.npy`` files there instead of memory (created, and overwritten when the buffer allocates)."""

    def __init__(self, capacity: int, *, directory: str | Path | None = None):
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"ReplayBuffer capacity={capacity!r}: must be an int >= 1")
        self.capacity = capacity
        self.directory = None if directory is None else Path(directory)
        self.stored = 0  # transitions ever added
        self.evicted = 0  # of those, overwritten by later ones
        self._next = 0  # the ring's write position
        self._spec: dict[Key, tuple[tuple[int, ...], str]] | None = None  # per leaf: (shape, dtype)
        self._arrays: dict[Key, np.ndarray] = {}

    def __len__(self) -> int:
        return self.stored - self.evicted

    def counters(self) -> dict[str, int]:
        """``replay_stored`` (ever added), ``replay_size`` (held now), ``replay_evicted`` (overwritten)."""
        return {"replay_stored": self.stored, "replay_size": len(self), "replay_evicted": self.evicted}

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self._arrays.values()))

    # ---- storage ------------------------------------------------------------------------------

    def _allocate(self, leaves: dict[Key, np.ndarray]) -> None:
        self._spec = {k: (tuple(v.shape[1:]), str(v.dtype)) for k, v in leaves.items()}
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            (self.directory / "layout.json").write_text(json.dumps(
                {"capacity": self.capacity, "leaves": [["/".join(k), list(s), d] for k, (s, d) in self._spec.items()]}))
        for i, (key, (shape, dtype)) in enumerate(self._spec.items()):
            if self.directory is None:
                self._arrays[key] = np.zeros((self.capacity, *shape), dtype)
            else:
                self._arrays[key] = np.lib.format.open_memmap(self._file(i, key), mode="w+", dtype=dtype,
                                                              shape=(self.capacity, *shape))

    def _file(self, i: int, key: Key) -> Path:
        return self.directory / f"{i:03d}-{re.sub(r'[^A-Za-z0-9_.-]', '_', '.'.join(key))}.npy"

    def __getstate__(self) -> dict:
        """Picklable (the algorithm owning it may go to a learner process): a disk buffer travels
        as its directory and is mapped again on the other side."""
        state = dict(self.__dict__)
        if self.directory is not None:
            for a in self._arrays.values():
                a.flush()
            state["_arrays"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self._arrays is None:
            self._arrays = {key: np.load(self._file(i, key), mmap_mode="r+")
                            for i, key in enumerate(self._spec or {})}

    # ---- adding and sampling -------------------------------------------------------------------

    def add(self, transitions: dict[str, Any]) -> int:
        """Append a batch of transitions (:data:`FIELDS`, tensors or arrays with the batch first);
        past ``capacity`` the oldest are overwritten. Returns how many were added."""
        missing = [f for f in FIELDS if f not in transitions]
        if missing:
            raise ValueError(f"ReplayBuffer.add: transitions lack {missing}")
        leaves: dict[Key, np.ndarray] = {}
        for f in FIELDS:
            leaves.update(_flatten(f, transitions[f]))
        n = len(leaves[("rewards",)])
        if n == 0:
            return 0
        if self._spec is None:
            self._allocate(leaves)
        if set(leaves) != set(self._spec):
            raise ValueError(f"ReplayBuffer.add: the transitions hold {sorted('/'.join(k) for k in leaves)}, the "
                             f"buffer {sorted('/'.join(k) for k in self._spec)}")
        for key, v in leaves.items():
            if len(v) != n or tuple(v.shape[1:]) != self._spec[key][0]:
                raise ValueError(f"ReplayBuffer.add: {'/'.join(key)} has shape {tuple(v.shape)}, the buffer stores "
                                 f"[{n}, *{self._spec[key][0]}]")
        keep = min(n, self.capacity)  # of a batch larger than the ring, only its last rows survive
        pos = (self._next + n - keep + np.arange(keep)) % self.capacity
        for key, v in leaves.items():
            self._arrays[key][pos] = v[n - keep:]
        before = len(self)
        self.stored += n
        self.evicted += max(0, before + n - self.capacity)
        self._next = (self._next + n) % self.capacity
        return n

    def sample(self, n: int, rng: np.random.Generator, device: torch.device | str | None = None) -> dict[str, Any]:
        """``n`` transitions drawn uniformly with replacement, as tensors (on ``device``)."""
        if len(self) == 0:
            raise ValueError("ReplayBuffer.sample: the buffer is empty")
        return self.gather(rng.integers(len(self), size=n), device)

    def gather(self, idx: np.ndarray, device: torch.device | str | None = None) -> dict[str, Any]:
        """The transitions at ring positions ``idx`` (each below ``len(self)``), as tensors."""
        out = {k: torch.from_numpy(np.ascontiguousarray(a[idx])) for k, a in self._arrays.items()}
        if device is not None:
            out = {k: v.to(device, non_blocking=True) for k, v in out.items()}
        return _unflatten(out)


def sample_mixed(online: ReplayBuffer, demos: ReplayBuffer | None, n: int, demo_ratio: float,
                 rng: np.random.Generator, device: torch.device | str | None = None) -> tuple[dict[str, Any], int]:
    """``n`` transitions, ``round(n * demo_ratio)`` of them from ``demos`` and the rest from
    ``online`` (RLPD's symmetric sampling at ``demo_ratio=0.5``), demonstrations first; returns
    them and how many came from the demonstrations. Leaves of the demonstrations take the online
    data's dtypes. Without demonstrations (or an empty buffer), all come from ``online``."""
    k = round(n * demo_ratio) if demos is not None and len(demos) else 0
    if k == 0:
        return online.sample(n, rng, device), 0
    if k == n or len(online) == 0:
        return demos.sample(n, rng, device), n
    a, b = demos.sample(k, rng, device), online.sample(n - k, rng, device)

    def cat(x, y):
        if isinstance(y, dict):
            return {key: cat(x[key], y[key]) for key in y}
        return torch.cat([x.to(y.dtype), y])

    return cat(a, b), k


def load_demos(demos: Any, observation_space, action_shape: tuple[int, ...], *, gamma: float, n_step: int = 1,
               time_limit: int | None = None, directory: str | Path | None = None) -> ReplayBuffer:
    """A buffer holding exactly the n-step transitions of ``demos`` (a LeRobot dataset directory,
    read by :func:`~ebrl.demos.lerobot.read_lerobot`, or a :class:`~ebrl.demos.Demos`) for an env
    of ``observation_space`` and actions of ``action_shape`` (see
    :func:`~ebrl.algos.transitions.demo_transitions`, which says how episode ends are read)."""
    from ebrl.algos.transitions import demo_transitions
    from ebrl.demos.lerobot import read_lerobot

    if isinstance(demos, (str, Path)):
        demos = read_lerobot(demos)
    if len(demos) == 0:
        raise ValueError("the demonstrations have no frames")
    t = demo_transitions(demos, observation_space, tuple(action_shape), gamma, n_step, time_limit)
    n = len(t["rewards"])
    if n == 0:
        raise ValueError("the demonstrations hold no usable transition (every episode a single frame without "
                         "next.done)")
    buf = ReplayBuffer(n, directory=directory)
    buf.add(t)
    return buf
