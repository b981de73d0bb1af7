"""Weights on local disk: ``save_pretrained(dir)`` / ``from_pretrained(dir)`` for the policies
that keep their constructor arguments in ``self.config`` (safetensors for the tensors, JSON for
the arguments, as Hugging Face lays a model out). Local directories only: EBRL never fetches
weights from a hub.

    >>> import tempfile, numpy as np
    >>> import gymnasium as gym
    >>> from ebrl.policies import FlowPolicy
    >>> p = FlowPolicy.from_spaces(gym.spaces.Box(-1, 1, (3,)), gym.spaces.Box(-1, 1, (2,)), hidden=(8,), seed=0)
    >>> with tempfile.TemporaryDirectory() as d:
    ...     p.save_pretrained(d)
    ...     q = FlowPolicy.from_pretrained(d)
    >>> all(bool((a == b).all()) for a, b in zip(p.state_dict().values(), q.state_dict().values()))
    True
"""

from __future__ import annotations

import json
from pathlib import Path

WEIGHTS_NAME, CONFIG_NAME = "model.safetensors", "config.json"


class Pretrained:
    """Mixin for an ``nn.Module`` whose ``config`` dict rebuilds it (``cls(**config)``)."""

    config: dict
    # constructor arguments added after weights were first saved, with the value that reproduces
    # those older weights: a config.json without the key loads as it did when it was written
    CONFIG_BEFORE_KEY: dict = {}

    def save_pretrained(self, path: str | Path) -> None:
        """Write ``model.safetensors`` (the state_dict) and ``config.json`` (the constructor arguments)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}, str(path / WEIGHTS_NAME))
        (path / CONFIG_NAME).write_text(json.dumps({"policy": type(self).__name__, **self.config}, indent=2) + "\n")

    @classmethod
    def from_pretrained(cls, path: str | Path):
        """Rebuild a policy that :meth:`save_pretrained` wrote into the local directory ``path`` (on the CPU)."""
        from safetensors.torch import load_file

        path = Path(path)
        for name in (CONFIG_NAME, WEIGHTS_NAME):
            if not (path / name).is_file():
                raise FileNotFoundError(f"{cls.__name__}.from_pretrained: {path / name} does not exist "
                                        "(local directories only)")
        config = json.loads((path / CONFIG_NAME).read_text())
        kind = config.pop("policy", cls.__name__)
        if kind != cls.__name__:
            raise ValueError(f"{path / CONFIG_NAME} holds a {kind}, not a {cls.__name__}")
        policy = cls(**{**cls.CONFIG_BEFORE_KEY, **config})
        policy.load_state_dict(load_file(str(path / WEIGHTS_NAME)))
        return policy
