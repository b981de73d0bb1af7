"""What ``run()`` reads of env 0 before it starts anything: its spaces and its time limit.

One inspection serves both start-up checks: the policy against the env's spaces
(:func:`ebrl.policies.expects.check_policy_spaces`) and the algorithm's needs against the
time limit (:func:`ebrl.algos.resolve_run_config`). The start-up probe reads them from the
env 0 it builds (:mod:`ebrl.runtime.probe`).

    >>> from ebrl.testing import MockEnv
    >>> facts = EnvFacts.of(MockEnv(dim=3))
    >>> facts.action_space.shape, facts.max_episode_steps
    ((3,), None)
"""

from __future__ import annotations

from dataclasses import dataclass

import gymnasium as gym

from ebrl.runtime.sim.stepping import single_spaces


@dataclass(frozen=True)
class EnvFacts:
    """One env's spaces (a vector env's single-env ones) and time limit."""

    observation_space: gym.Space
    action_space: gym.Space
    max_episode_steps: int | None  # env.spec.max_episode_steps; None: no time limit declared

    @classmethod
    def of(cls, env: gym.Env | gym.vector.VectorEnv) -> EnvFacts:
        obs, act = single_spaces(env)
        limit = getattr(getattr(env, "spec", None), "max_episode_steps", None)
        return cls(obs, act, int(limit) if limit else None)
