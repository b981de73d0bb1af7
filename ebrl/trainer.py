"""Trainer: what to train (envs, policy, algorithm) and how (RunConfig)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import gymnasium as gym

from ebrl.config import ConfigError, RunConfig


@dataclass
class Trainer:
    """Everything ``ebrl.run`` needs.

    ``env_fn(i)`` builds env ``i``; it is called again to rebuild an env that failed, and in
    worker processes for the process sim backend. ``policy`` is the learner's copy; the
    generator acts with a deep copy that receives published weights between batches.
    """

    env_fn: Callable[[int], gym.Env]
    policy: object
    algo: object
    config: RunConfig = field(default_factory=RunConfig)
    env_steps_done: int = 0  # env steps of earlier runs this one continues (set by load_checkpoint)

    def __post_init__(self) -> None:
        if not callable(self.env_fn):
            raise ConfigError("env_fn", self.env_fn, "must be a callable taking the env index")
        if not callable(getattr(self.policy, "act", None)):
            raise ConfigError("policy", type(self.policy).__name__, "must have an act(obs) method (ebrl.policies.Policy)")
        if not callable(getattr(self.algo, "update", None)):
            raise ConfigError("algo", type(self.algo).__name__, "must have an update(policy, batch) method")
        if isinstance(self.config, dict):
            self.config = RunConfig.from_dict(self.config)
        if not isinstance(self.config, RunConfig):
            raise ConfigError("config", self.config, "must be a RunConfig or a dict of its fields")
