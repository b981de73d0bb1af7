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

import inspect
import json
from pathlib import Path

WEIGHTS_NAME, CONFIG_NAME = "model.safetensors", "config.json"


class Pretrained:
    """Mixin for an ``nn.Module`` whose ``config`` dict rebuilds it (``cls(**config)``)."""

    config: dict

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
        accepted = inspect.signature(cls).parameters
        unexpected = sorted(k for k in config if k not in accepted)
        if unexpected:
            raise ValueError(f"{path / CONFIG_NAME} has keys {cls.__name__} does not take: {unexpected}")
        policy = cls(**config)
        # a key left out would take the constructor's default, which the weights may not have been trained with
        missing = sorted(k for k in policy.config if k not in config)
        if missing:
            raise ValueError(f"{path / CONFIG_NAME} lacks keys {cls.__name__} saves: {missing}")
        policy.load_state_dict(load_file(str(path / WEIGHTS_NAME)))
        return policy
