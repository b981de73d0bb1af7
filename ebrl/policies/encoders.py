"""One observation encoder for every policy: image and vector entries found by their spaces.

Any observation a simulator gives is read the way Stable-Baselines3's ``MultiInputPolicy``
(``CombinedExtractor``) reads it, whatever its entries are called:

- an **image** is a ``uint8`` Box of three dimensions, channels last ``(H, W, C)`` or first
  ``(C, H, W)`` (the smaller of the two end axes is the channels; a tie is channels last). Each
  camera gets its own network from the policy (a CNN, or a patchifier for the token policy) and
  is scaled by 1/255 inside it, so frames stay ``uint8`` until they reach the policy's device;
- every other **Box** is a vector: flattened, concatenated, normalised by a running mean and
  variance (buffers, so the statistics travel with ``state_dict``);
- ``Discrete`` and ``MultiDiscrete`` entries are one-hot, ``MultiBinary`` entries 0/1 floats
  (neither normalised);
- nested ``Dict`` spaces are walked. An entry's key is its path joined by ``/``
  (``sensor_data/base_camera/rgb``), and observations may arrive nested or flattened by those keys.

**Order.** Images first, then Box vectors, then one-hot and binary entries, each group in the
space's own order, depth first (gymnasium sorts the keys of a plain ``dict``).

**Choosing.** ``image_keys=[...]`` names the images and ``state_keys=[...]`` the other entries,
each in the order given (a key naming a ``Dict`` selects every entry under it); ``None`` (the
default) keeps the rule above for that group, and an entry a given list leaves out is not read.
A float Box is an image only when ``image_keys`` names it (it is not scaled); a camera is
flattened into the vector only when ``state_keys`` names it.

**Errors.** An entry nothing here can read (a ``Text`` or ``Graph`` space, a 2-D ``uint8`` Box,
which is not an image) is one ``ValueError`` naming its key and space when the policy is built,
before anything runs.

Example (a ManiSkill-style nested observation; the batch may mix nested and ``/``-joined keys)::

    >>> import gymnasium as gym, numpy as np, torch
    >>> from ebrl.policies.encoders import ObsEncoder, ObsLayout
    >>> space = gym.spaces.Dict({
    ...     "agent": gym.spaces.Dict({"qpos": gym.spaces.Box(-1, 1, (9,)), "gripper": gym.spaces.Discrete(2)}),
    ...     "sensor_data": gym.spaces.Dict({"hand": gym.spaces.Dict({
    ...         "rgb": gym.spaces.Box(0, 255, (3, 16, 16), np.uint8)})})})
    >>> layout = ObsLayout.from_space(space)
    >>> [(e.key, e.read.value, e.size) for e in layout.entries]
    [('sensor_data/hand/rgb', 'image', 768), ('agent/qpos', 'vector', 9), ('agent/gripper', 'one-hot', 2)]
    >>> conv = lambda entry: torch.nn.Sequential(torch.nn.Conv2d(entry.channels, 4, 4, 4), torch.nn.Flatten())
    >>> encoder = ObsEncoder(layout, image_net=conv)
    >>> encoder.out_dim  # 4 channels of 4 x 4 from the camera, then 9 + 2
    75
    >>> obs = {"agent": {"qpos": np.zeros((5, 9), np.float32), "gripper": np.array([0, 1, 1, 0, 1])},
    ...        "sensor_data/hand/rgb": np.zeros((5, 3, 16, 16), np.uint8)}
    >>> encoder(obs).shape
    torch.Size([5, 75])
    >>> ObsLayout.from_space(gym.spaces.Dict({"depth": gym.spaces.Box(0, 255, (8, 8), np.uint8)}))
    Traceback (most recent call last):
    ...
    ValueError: the policy cannot read observation entry 'depth', Box(0, 255, (8, 8), uint8): a 2-D uint8 Box ...
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from torch import Tensor, nn

from ebrl.policies.expects import DType, ObsSpec
from ebrl.policies.heads import merge_moments, register_moments

OBS_CLIP = 10.0  # normalised vectors are clipped to [-10, 10], as SB3's VecNormalize
EPS = 1e-8

Path = tuple[str, ...]  # () is the whole observation (a space that is not a Dict)


class Read(enum.StrEnum):
    """How an entry becomes network input."""

    IMAGE = "image"  # [N, C, H, W] to the policy's image network
    VECTOR = "vector"  # flattened, normalised
    ONE_HOT = "one-hot"  # Discrete / MultiDiscrete
    BINARY = "binary"  # MultiBinary, as 0/1 floats


@dataclass(frozen=True)
class ObsEntry:
    """One leaf of the observation the policy reads."""

    path: Path
    read: Read
    shape: tuple[int, ...] | None  # one env's; None: a member of a group of known total size only
    dtype: str = "float32"
    channels_first: bool = False  # images
    classes: tuple[int, ...] = ()  # one-hot: the classes of each element (flattened)
    starts: tuple[int, ...] = ()  # one-hot: each element's first value

    @property
    def key(self) -> str:
        return "/".join(self.path)

    @property
    def name(self) -> str:
        """For messages: ``'key'``, or "the observation" for a space that is not a Dict."""
        return repr(self.key) if self.path else "the observation"

    @property
    def size(self) -> int:
        """Elements it gives the network (an image's pixels times channels; a one-hot's classes)."""
        if self.read is Read.ONE_HOT:
            return sum(self.classes)
        if self.shape is None:
            raise ValueError(f"observation entry {self.name} has no known size")
        return math.prod(self.shape)

    @property
    def chw(self) -> tuple[int, int, int]:
        """An image's ``(channels, height, width)``."""
        a, b, c = self.shape  # type: ignore[misc]
        return (a, b, c) if self.channels_first else (c, a, b)

    @property
    def channels(self) -> int:
        return self.chw[0]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": list(self.path), "read": self.read.value,
                               "shape": None if self.shape is None else list(self.shape), "dtype": self.dtype}
        if self.read is Read.IMAGE:
            out["channels_first"] = self.channels_first
        if self.read is Read.ONE_HOT:
            out.update(classes=list(self.classes), starts=list(self.starts))
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ObsEntry:
        return cls(tuple(d["path"]), Read(d["read"]), None if d["shape"] is None else tuple(d["shape"]),
                   d.get("dtype", "float32"), bool(d.get("channels_first", False)),
                   tuple(d.get("classes", ())), tuple(d.get("starts", ())))

    def describe(self) -> dict[str, Any]:
        """What ``spec.json`` and the run's ``policy_inputs`` log line say about it."""
        out: dict[str, Any] = {"key": self.key if self.path else None, "as": self.read.value,
                               "shape": None if self.shape is None else list(self.shape), "dtype": self.dtype}
        if self.read is Read.IMAGE:
            out["channels"] = "first" if self.channels_first else "last"
        if self.read is Read.ONE_HOT:
            out["classes"] = list(self.classes)
        return out


def _leaves(space: spaces.Space, path: Path = ()) -> Iterator[tuple[Path, spaces.Space]]:
    if isinstance(space, spaces.Dict):
        for key, sub in space.spaces.items():
            yield from _leaves(sub, (*path, key))
    else:
        yield path, space


def _looks_like_image(space: spaces.Space) -> bool:
    return isinstance(space, spaces.Box) and space.dtype == np.uint8 and len(space.shape) == 3


def _image_entry(path: Path, space: spaces.Space) -> ObsEntry:
    shape = tuple(int(d) for d in space.shape)
    # SB3 takes the smallest axis for the channels; a tie stays channels last, as HWC frames were read before
    return ObsEntry(path, Read.IMAGE, shape, str(space.dtype), channels_first=shape[0] < shape[2])


def _vector_entry(path: Path, space: spaces.Space) -> ObsEntry | None:
    """The entry for a non-image leaf, or None if nothing here reads it."""
    if isinstance(space, spaces.Box):
        return ObsEntry(path, Read.VECTOR, tuple(int(d) for d in space.shape), str(space.dtype))
    if isinstance(space, spaces.Discrete):
        return ObsEntry(path, Read.ONE_HOT, (), "int64", classes=(int(space.n),), starts=(int(space.start),))
    if isinstance(space, spaces.MultiDiscrete):
        return ObsEntry(path, Read.ONE_HOT, tuple(int(d) for d in space.shape), "int64",
                        classes=tuple(int(n) for n in np.ravel(space.nvec)),
                        starts=tuple(int(s) for s in np.ravel(space.start)))
    if isinstance(space, spaces.MultiBinary):
        return ObsEntry(path, Read.BINARY, tuple(int(d) for d in space.shape), "int8")
    return None


@dataclass(frozen=True)
class ObsLayout:
    """Which entries a policy reads, and how: built by :meth:`from_space`, saved by
    :meth:`to_config` (a JSON-ready list) and rebuilt by :meth:`from_config`."""

    images: tuple[ObsEntry, ...] = ()
    vectors: tuple[ObsEntry, ...] = ()  # Box entries: normalised together
    categorical: tuple[ObsEntry, ...] = ()  # one-hot and binary entries: not normalised
    ignored: tuple[str, ...] = ()  # keys present but not chosen (image_keys / state_keys)
    group_dim: int = 0  # total size of the vector entries of unknown shape (FlowPolicy's obs_keys)

    @property
    def entries(self) -> tuple[ObsEntry, ...]:
        return (*self.images, *self.vectors, *self.categorical)

    @property
    def vector_dim(self) -> int:
        """Elements of the Box part (what the running mean/variance cover)."""
        return sum(e.size for e in self.vectors if e.shape is not None) + self.group_dim

    @property
    def flat_dim(self) -> int:
        """Elements of everything but the images: the vector part, then one-hot and binary."""
        return self.vector_dim + sum(e.size for e in self.categorical)

    @classmethod
    def vector(cls, shape: Sequence[int]) -> ObsLayout:
        """A Box observation read whole as one vector (whatever its dtype)."""
        return cls(vectors=(ObsEntry((), Read.VECTOR, tuple(int(d) for d in shape)),))

    @classmethod
    def from_space(cls, space: spaces.Space, *, image_keys: Sequence[str] | None = None,
                   state_keys: Sequence[str] | None = None, exclude: Sequence[str] = ()) -> ObsLayout:
        """The entries of ``space`` a policy reads (see the module's docstring for the rules).
        ``exclude`` leaves keys out that the policy reads some other way."""
        leaves = list(_leaves(space))
        if not isinstance(space, spaces.Dict) and (image_keys or state_keys):
            raise ValueError(f"image_keys/state_keys name entries of a Dict observation space; {space} is read whole")
        keys = {"/".join(p): p for p, _ in leaves}
        by_path = dict(leaves)

        def select(names: Sequence[str], arg: str) -> list[Path]:
            if isinstance(names, str):
                raise ValueError(f"{arg} must be a list of keys, got the string {names!r}")
            chosen: list[Path] = []
            for name in names:
                found = [p for k, p in keys.items() if k == name or k.startswith(f"{name}/")]
                if not found:
                    raise ValueError(f"{arg} names {name!r}, which the observation space does not have "
                                     f"(its entries: {list(keys)})")
                chosen += [p for p in found if p not in chosen]
            return chosen

        left_out = set(select(exclude, "exclude")) if exclude else set()
        named_states = select(state_keys, "state_keys") if state_keys is not None else None
        if image_keys is not None:
            images = select(image_keys, "image_keys")
        else:
            images = [p for p, s in leaves if _looks_like_image(s) and p not in left_out
                      and p not in (named_states or ())]
        both = [p for p in images if named_states is not None and p in named_states]
        if both:
            raise ValueError(f"{['/'.join(p) for p in both]} are named in both image_keys and state_keys")
        if named_states is not None:
            states = named_states
        else:  # every other leaf, but no unnamed camera when image_keys chose the images
            states = [p for p, s in leaves if p not in images and p not in left_out
                      and not (image_keys is not None and _looks_like_image(s))]

        problems: list[str] = []
        image_entries, vectors, categorical = [], [], []
        for p in images:
            s = by_path[p]
            if isinstance(s, spaces.Box) and len(s.shape) == 3:
                image_entries.append(_image_entry(p, s))
            else:
                problems.append(f"{_name(p)}, {s}: image_keys names it, but images are Boxes of 3 dimensions, "
                                "(H, W, C) or (C, H, W)")
        for p in states:
            s = by_path[p]
            entry = _vector_entry(p, s)
            if entry is None:
                problems.append(f"{_name(p)}, {s}: no policy input reads a {type(s).__name__} space (they read "
                                "Boxes, Discrete, MultiDiscrete and MultiBinary entries, and Dicts of them)")
            elif (named_states is None and isinstance(s, spaces.Box) and s.dtype == np.uint8
                  and len(s.shape) >= 2):
                fix = ("reshape it to one, or name it in state_keys to read it flattened" if p else
                       "reshape it to one (gymnasium.wrappers.ReshapeObservation), or use MLPPolicy, which reads it "
                       "flattened")
                problems.append(f"{_name(p)}, {s}: a {len(s.shape)}-D uint8 Box is not an image (images are uint8 "
                                f"Boxes (H, W, C) or (C, H, W)): {fix}")
            elif entry.read is Read.VECTOR:
                vectors.append(entry)
            else:
                categorical.append(entry)
        if problems:
            if not isinstance(space, spaces.Dict):
                raise ValueError(f"the policy cannot read {problems[0]}")
            what = "entry" if len(problems) == 1 else "entries"
            hint = "" if named_states is not None else "; choose the entries to read with state_keys=[...]"
            raise ValueError(f"the policy cannot read observation {what} " + "; ".join(problems) + hint)
        chosen = {*images, *states}
        ignored = tuple("/".join(p) for p, _ in leaves if p not in chosen)
        layout = cls(tuple(image_entries), tuple(vectors), tuple(categorical), ignored)
        if not layout.entries and not left_out:
            raise ValueError(f"the policy reads nothing from the observation space {space}")
        return layout

    def to_config(self) -> list[dict[str, Any]]:
        """JSON-ready, for a policy's ``config``."""
        if self.group_dim:
            raise ValueError("a layout with entries of unknown shape is saved by its policy's own arguments")
        return [e.to_json() for e in self.entries]

    @classmethod
    def from_config(cls, config: ObsLayout | Sequence[Mapping[str, Any]]) -> ObsLayout:
        if isinstance(config, ObsLayout):
            return config
        entries = [ObsEntry.from_json(d) for d in config]
        return cls(tuple(e for e in entries if e.read is Read.IMAGE),
                   tuple(e for e in entries if e.read is Read.VECTOR),
                   tuple(e for e in entries if e.read in (Read.ONE_HOT, Read.BINARY)))

    def expected(self) -> tuple[ObsSpec, ...]:
        """The :class:`~ebrl.policies.expects.ObsSpec` of every entry, for ``expected_spaces()``."""
        def keys(e: ObsEntry) -> tuple[str, ...] | None:
            return (e.key,) if e.path else None

        out = []
        for e in self.images:
            out.append(ObsSpec(keys=keys(e), shape=e.shape, dtype=DType.UINT8 if e.dtype == "uint8" else None))
        for e in self.vectors:
            if e.shape is not None:
                out.append(ObsSpec(keys=keys(e), size=e.size))
        group = [e.key for e in self.vectors if e.shape is None]
        if group:
            out.append(ObsSpec(keys=tuple(group), size=self.group_dim))
        for e in self.categorical:
            out.append(ObsSpec(keys=keys(e), size=e.size, dtype=DType.CATEGORICAL))
        return tuple(out)

    def describe(self) -> list[dict[str, Any]]:
        """One dict per entry (``key``, ``as``, ``shape``, ...), then the keys left out."""
        return [e.describe() for e in self.entries] + [{"key": k, "as": "ignored"} for k in self.ignored]


def _name(path: Path) -> str:
    return repr("/".join(path)) if path else "the observation"


def lookup(obs: Any, path: Path) -> Any:
    """The leaf at ``path`` of a batch: nested dicts, keys joined by ``/``, or a mix of both.

        >>> lookup({"a/b": 1, "c": {"d": 2}}, ("a", "b")), lookup({"a/b": 1, "c": {"d": 2}}, ("c", "d"))
        (1, 2)
    """
    if not path:
        return obs
    if not isinstance(obs, Mapping):
        raise TypeError(f"the policy reads observation entry {'/'.join(path)!r}, but got a "
                        f"{type(obs).__name__}, not a dict")
    for i in range(len(path), 0, -1):  # the longest joined prefix first: flattened keys, then nesting
        key = "/".join(path[:i])
        if key in obs:
            return lookup(obs[key], path[i:])
    raise KeyError(f"the observation has no entry {'/'.join(path)!r} (it has {list(obs)})")


def _rows(a: Any, entry: ObsEntry) -> Any:
    """A batch of one entry as ``[N, size]`` (an array or a tensor): leading axes beyond the
    first are rows too when the entry's shape is known, as a Box observation always was read."""
    if entry.shape is not None:
        return a.reshape(-1, entry.size)
    return a.reshape(a.shape[0], math.prod(a.shape[1:]))


def as_tensor(a: Any, device: torch.device) -> Tensor:
    """A tensor on ``device``, without copying numpy memory unless it is strided or read-only."""
    if isinstance(a, Tensor):
        return a.to(device, non_blocking=True)
    a = np.ascontiguousarray(a)
    if not a.flags.writeable:  # torch.from_numpy warns on read-only memory
        a = a.copy()
    return torch.from_numpy(a).to(device, non_blocking=True)


class ObsEncoder(nn.Module):
    """Reads a batch of observations as ``layout`` says: ``forward`` gives ``[N, out_dim]``
    features, each camera's network output (flattened) then :meth:`vector`.

    ``image_net(entry)`` builds one camera's network (input ``[N, C, H, W]``); a policy without
    one refuses layouts with images. ``normalize`` keeps a running mean and variance of the Box
    part (:meth:`update_stats`). ``like`` (a tensor of the policy's) gives the device and dtype of
    the features; by default the encoder's own.
    """

    def __init__(self, layout: ObsLayout, *, image_net: Callable[[ObsEntry], nn.Module] | None = None,
                 normalize: bool = True, owner: str = "the policy"):
        super().__init__()
        if layout.images and image_net is None:
            raise ValueError(f"{owner} has no image encoder, but {[e.key for e in layout.images]} are images: "
                             "use CNNPolicy (policy.kind=cnn, or auto), or name them in state_keys to read them "
                             "flattened")
        self.layout = layout
        self.images = nn.ModuleList([image_net(e) for e in layout.images] if image_net is not None else [])
        with torch.no_grad():  # each camera's feature size, from a pass over zeros
            self.image_dims = [int(net(torch.zeros(1, *e.chw)).flatten(1).shape[1])
                               for net, e in zip(self.images, layout.images)]
        self.out_dim = sum(self.image_dims) + layout.flat_dim
        self.normalize = bool(normalize) and layout.vector_dim > 0
        self.frozen = False  # True: update_stats merges nothing (RL from SFT weights keeps their statistics)
        if self.normalize:
            register_moments(self, layout.vector_dim)

    def _target(self, like: Tensor | None) -> tuple[torch.device, torch.dtype]:
        if like is None:
            like = next((t for t in (*self.parameters(), *self.buffers()) if t.is_floating_point()), None)
        return (like.device, like.dtype) if like is not None else (torch.device("cpu"), torch.get_default_dtype())

    def forward(self, obs: Any, like: Tensor | None = None) -> Tensor:
        parts = [f.flatten(1) for f in self.image_features(obs, like)]
        if self.layout.flat_dim:
            parts.append(self.vector(obs, like))
        return parts[0] if len(parts) == 1 else torch.cat(parts, -1)

    def pixels(self, obs: Any, like: Tensor | None = None) -> list[Tensor]:
        """Each camera as ``[N, C, H, W]`` floats, ``uint8`` scaled to ``[0, 1]``."""
        device, dtype = self._target(like)
        out = []
        for e in self.layout.images:
            x = as_tensor(lookup(obs, e.path), device).reshape(-1, *e.shape)
            if not e.channels_first:
                x = x.permute(0, 3, 1, 2)
            x = x.to(dtype)
            out.append(x * (1.0 / 255.0) if e.dtype == "uint8" else x)
        return out

    def image_features(self, obs: Any, like: Tensor | None = None) -> list[Tensor]:
        """Each camera's network output, in layout order."""
        return [net(x) for net, x in zip(self.images, self.pixels(obs, like))]

    def _raw_vector(self, obs: Any, device: torch.device, dtype: torch.dtype) -> Tensor:
        """``[N, vector_dim]``: the Box entries flattened and joined, before normalisation."""
        # sizes, not -1: a batch of no rows (a data-parallel rank without any) keeps its width
        parts = [_rows(as_tensor(lookup(obs, e.path), device), e).to(dtype) for e in self.layout.vectors]
        return parts[0] if len(parts) == 1 else torch.cat(parts, -1)

    def vector(self, obs: Any, like: Tensor | None = None) -> Tensor:
        """``[N, flat_dim]``: the normalised Box part (clipped to ±10), then one-hot and binary entries."""
        device, dtype = self._target(like)
        parts = []
        if self.layout.vectors:
            x = self._raw_vector(obs, device, dtype)
            if self.normalize:
                x = ((x - self.obs_mean) / torch.sqrt(self.obs_var + EPS)).clamp(-OBS_CLIP, OBS_CLIP)
            parts.append(x)
        for e in self.layout.categorical:
            t = as_tensor(lookup(obs, e.path), device)
            if e.read is Read.BINARY:
                parts.append(t.reshape(-1, e.size).to(dtype))
                continue
            ids = t.reshape(-1, len(e.classes)).long()
            parts.append(torch.cat([nn.functional.one_hot(ids[:, i] - start, n) for i, (n, start)
                                    in enumerate(zip(e.classes, e.starts))], -1).to(dtype))
        return parts[0] if len(parts) == 1 else torch.cat(parts, -1)

    def vector_numpy(self, obs: Any) -> np.ndarray:
        """The Box part as ``float32 [N, vector_dim]`` in numpy, before normalisation (for the
        MLP's numpy inference; layouts of Box entries only)."""
        parts = [_rows(np.asarray(lookup(obs, e.path), np.float32), e) for e in self.layout.vectors]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, 1)

    @torch.no_grad()
    def update_stats(self, obs: Any) -> None:
        """Merge a batch into the running mean/variance of the Box part (parallel Welford, as SB3);
        nothing while :attr:`frozen`."""
        if self.normalize and not self.frozen:
            x = self._raw_vector(obs, self.obs_mean.device, torch.float64)
            merge_moments(self.obs_mean, self.obs_var, self.obs_count, x)

    def describe(self) -> list[dict[str, Any]]:
        """:meth:`ObsLayout.describe`, with each camera's feature size and whether vectors are normalised."""
        out = self.layout.describe()
        for d, size in zip(out, self.image_dims):
            d["features"] = size
        for d, e in zip(out[len(self.image_dims):], self.layout.entries[len(self.image_dims):]):
            if e.read is Read.VECTOR:
                d["normalised"] = self.normalize
        return out


class ReadsObservations:
    """What the policies here share about observations: an ``obs_encoder`` (an
    :class:`ObsEncoder`), which holds the layout and the running statistics."""

    obs_encoder: ObsEncoder
    # True: act() returns the mode (a Gaussian's mean, the likeliest token, a flow from zero
    # noise) instead of a sample: ebrl eval --deterministic, demonstrations from a policy
    deterministic: bool = False

    @property
    def obs_layout(self) -> ObsLayout:
        return self.obs_encoder.layout

    def describe_inputs(self) -> list[dict[str, Any]]:
        """The observation entries this policy reads, and how (``ebrl.run`` logs them as
        ``policy_inputs``; ``ebrl train`` writes them into ``spec.json``)."""
        return self.obs_encoder.describe()

    @torch.no_grad()
    def update_obs_stats(self, obs: Any) -> None:
        """Merge a batch of observations into the running mean/variance of their Box part
        (nothing once :meth:`freeze_obs_stats` was called)."""
        self.obs_encoder.update_stats(obs)

    def freeze_obs_stats(self, frozen: bool = True) -> None:
        """Keep the observation statistics as they are (``frozen=False`` lets updates merge again).

        Weights trained on demonstrations compute their actions from inputs normalised by the
        demonstrations' statistics. RL from them (``policy.init``) would merge its own rollouts'
        statistics, which differ (the clone's noisy states; a joint the expert never moved has a
        variance near 0): the inputs the weights see shift, and the clone degrades before RL
        can help it. Freezing them is SB3's ``VecNormalize(training=False)`` for a loaded model.
        """
        self.obs_encoder.frozen = bool(frozen)
