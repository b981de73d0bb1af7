"""Demonstrations kept in RL's loss: DAPG's decaying behaviour-cloning term.

RL started from a policy cloned on few demonstrations drifts off the clone while its advantages
are still mostly noise (a fresh or misfit critic, rare successes). DAPG (Rajeswaran et al. 2018,
https://arxiv.org/abs/1709.10087) adds the behaviour-cloning loss of the demonstrations to
every RL step, weighted ``coef * decay ** update``: it holds the policy near them at first and
hands over to RL as the weight decays. Here each minibatch step of PPO, DecoupledPPO, V-trace or
GRPO adds :func:`ebrl.sft.bc_loss` (the loss ``ebrl sft`` trained the clone with) on a random
minibatch of demonstration frames; once the weight is under ``1e-3 * coef`` (about 1,400
updates at the default decay) the term is dropped and costs nothing.

    >>> import gymnasium as gym, numpy as np
    >>> from ebrl.algos import PPO
    >>> from ebrl.demos import Demos
    >>> obs_space, act_space = gym.spaces.Box(-1, 1, (3,)), gym.spaces.Box(-1, 1, (2,))
    >>> frames = {"observation.state": np.zeros((4, 3), np.float32), "action": np.ones((4, 2), np.float32)}
    >>> demos = DemoLoss(Demos(frames, [(0, 4)], ["reach"], 10.0), obs_space, act_space, coef=0.1, decay=0.5)
    >>> demos.weight(0), demos.weight(2)
    (0.1, 0.025)
    >>> ppo = PPO(demos=demos)   # or in a run's TOML: [ppo] demos = "DIR"
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor

from ebrl.config import ConfigError

DROP_BELOW = 1e-3  # of coef: a weight this small no longer moves the policy, only costs a forward pass


class DemoLoss:
    """The behaviour-cloning term of ``demos`` (a LeRobot dataset directory, or
    :class:`~ebrl.demos.Demos`) for a policy acting in these spaces, weighted
    ``coef * decay ** update``, on ``minibatch_size`` frames drawn at random each step."""

    def __init__(self, demos: Any, observation_space, action_space, *, coef: float = 0.1, decay: float = 0.995,
                 minibatch_size: int = 256, seed: int = 0):
        from ebrl.demos.lerobot import read_lerobot
        from ebrl.demos.features import ObsFeatures
        from ebrl.sft import demo_actions

        if not (isinstance(coef, (int, float)) and 0 < coef < math.inf):
            raise ConfigError("demo_coef", coef, "a finite number > 0")
        if not (isinstance(decay, (int, float)) and 0 < decay <= 1):
            raise ConfigError("demo_decay", decay, "a number in (0, 1]")
        if isinstance(demos, (str, Path)):
            demos = read_lerobot(demos)
        if len(demos) == 0:
            raise ValueError("the demonstrations have no frames")
        self.coef, self.decay, self.minibatch_size = float(coef), float(decay), int(minibatch_size)
        self.obs = ObsFeatures(observation_space).observations(demos.frames)
        self.actions = demo_actions(demos, tuple(action_space.shape))
        self._rng = np.random.default_rng(seed)  # picklable: the algorithm may go to a learner process

    def weight(self, update: int) -> float:
        """The term's weight at update ``update`` (0 once dropped)."""
        w = self.coef * self.decay ** update
        return w if w >= DROP_BELOW * self.coef else 0.0

    def __call__(self, policy, update: int) -> tuple[Tensor | None, float]:
        """``(bc_loss, weight)`` for one minibatch step; ``(None, 0.0)`` once the term is dropped."""
        from ebrl.sft import bc_loss, demo_batch

        weight = self.weight(update)
        if weight == 0.0:
            return None, 0.0
        rows = self._rng.integers(len(self.actions), size=min(self.minibatch_size, len(self.actions)))
        obs, actions = demo_batch(self.obs, self.actions, rows, next(policy.parameters()).device)
        return bc_loss(policy, obs, actions), weight
