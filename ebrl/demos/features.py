"""Between an env's observations and a LeRobot dataset's features.

An observation is a Box (``observation.state``) or a dict of entries, nested dicts joined with
dots: a camera (a ``uint8`` Box of rank 3) is ``observation.images.<entry>`` (stored
channels-last, as LeRobot's videos are), any other Box ``observation.<entry>``, a Discrete
(LIBERO's and ``mock/reach``'s ``instruction``) ``observation.<entry>`` as an int64.

    >>> import numpy as np
    >>> from gymnasium import spaces
    >>> space = spaces.Dict({"pixels": spaces.Box(0, 255, (3, 8, 8), np.uint8),
    ...                      "state": spaces.Box(-1, 1, (4,)), "instruction": spaces.Discrete(3)})
    >>> names = ObsFeatures(space)
    >>> names.features()
    {'observation.images.pixels': ((8, 8, 3), 'video'), 'observation.instruction': ((1,), 'int64'), 'observation.state': ((4,), 'float32')}
    >>> obs = space.sample()
    >>> back = names.observations({k: v[None] for k, v in names.frame(obs).items()})
    >>> bool((back["pixels"][0] == obs["pixels"]).all()), back["state"].shape, int(back["instruction"][0]) == int(obs["instruction"])
    (True, (1, 4), True)
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium import spaces

from ebrl.policies.encoders import _leaves
from ebrl.policies.encoders import _looks_like_image as _is_camera  # a uint8 Box of rank 3


def _chw(shape: tuple[int, ...]) -> bool:
    return shape[0] in (1, 3) and shape[-1] not in (1, 3)


class ObsFeatures:
    """The feature names, shapes and dtypes of an observation space, and conversions both ways.

    ``image_format``: ``"video"`` (MP4, LeRobot's default) or ``"image"`` (PNG in the parquet)."""

    def __init__(self, observation_space: spaces.Space, image_format: str = "video"):
        self.space = observation_space
        self.entries: list[tuple[tuple[str, ...], str, spaces.Space]] = []  # (path, feature name, space)
        for path, space in _leaves(observation_space):
            if _is_camera(space):
                if _chw(space.shape) or space.shape[-1] in (1, 3):
                    name = "observation.images." + ".".join(path) if path else "observation.image"
                else:
                    raise ValueError(f"observation entry {'.'.join(path) or '(the observation)'} has "
                                     f"{space.shape[-1]} channels: demonstrations store cameras of 1 or 3 "
                                     "channels (collect with frame_stack=1)")
            elif not path:
                name = "observation.state"
            else:
                name = "observation." + ".".join(path)
            self.entries.append((path, name, space))
        self.image_format = image_format

    def features(self) -> dict[str, tuple[tuple[int, ...], str]]:
        out = {}
        for path, name, space in sorted(self.entries, key=lambda e: e[1]):
            if _is_camera(space):
                h, w, c = (space.shape[1], space.shape[2], space.shape[0]) if _chw(space.shape) else space.shape
                out[name] = ((h, w, c), self.image_format)
            elif isinstance(space, spaces.Discrete):
                out[name] = ((1,), "int64")
            elif isinstance(space, spaces.Box):
                out[name] = (tuple(space.shape), "float32")
            else:
                raise ValueError(f"observation entry {'.'.join(path)}: {type(space).__name__} is not stored in "
                                 "demonstrations (Box and Discrete entries are)")
        return out

    def frame(self, obs: Any) -> dict[str, np.ndarray]:
        """One observation as feature values."""
        out = {}
        for path, name, space in self.entries:
            v = obs
            for key in path:
                v = v[key]
            v = np.asarray(v)
            if _is_camera(space) and _chw(space.shape):
                v = np.moveaxis(v, 0, -1)
            out[name] = v
        return out

    def observations(self, frames: dict[str, np.ndarray], rows: Any = slice(None)) -> Any:
        """Observations ``[n, ...]`` (a tree like the space) from a dataset's feature arrays."""
        missing = [name for _, name, _ in self.entries if name not in frames]
        if missing:
            raise KeyError(f"the dataset has no {missing} (features: {sorted(frames)}); the env's observation "
                           f"needs them")
        tree: dict = {}
        single = None
        for path, name, space in self.entries:
            v = frames[name][rows]
            if _is_camera(space):
                v = np.moveaxis(v, -1, 1) if _chw(space.shape) else v
                v = np.ascontiguousarray(v, np.uint8)
            elif isinstance(space, spaces.Discrete):
                v = np.asarray(v).reshape(-1).astype(np.int64)
            else:
                v = np.asarray(v, np.float32).reshape(len(v), *space.shape)
            if not path:
                single = v
                continue
            node = tree
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = v
        return single if single is not None else tree
