"""What every sim pool shares: :class:`StepOut`, :class:`EnvStepError`, the :class:`SimPool`
interface, and stepping one env with same-step autoreset.

Every backend resets an env in the same call as the step that ends its episode
(gymnasium's ``AutoresetMode.SAME_STEP``): ``StepOut.obs`` is then the first observation
of the next episode and ``final_obs`` the last one of the episode that ended.

    >>> import gymnasium as gym
    >>> env = gym.make("CartPole-v1")
    >>> obs, _ = reset_env(env, seed=0)
    >>> out = step_env(env, 1)
    >>> out.obs.shape, out.finite, out.final_obs is None
    ((4,), True, True)
"""

from __future__ import annotations

import math
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium as gym

from ebrl.config import SimBackend
from ebrl.spaces import all_finite, copy_tree

EnvFn = Callable[[int], gym.Env]


@dataclass(slots=True)
class StepOut:
    """One env step. When the episode ended, ``obs``/``info`` already belong to the next one."""

    obs: Any
    reward: float
    terminated: bool
    truncated: bool
    info: dict
    final_obs: Any = None  # last observation of the episode that ended at this step
    final_info: dict | None = None
    cost_s: float = 0.0  # declared cost (virtual time); 0 for real envs
    finite: bool = True  # reward and observation free of NaN/inf (checked where the step ran)


class EnvStepError(RuntimeError):
    """An env raised inside ``step``, ``reset`` or its constructor."""

    def __init__(self, env_id: int, op: str, detail: str):
        super().__init__(f"env {env_id} failed in {op}: {detail}")
        self.env_id, self.op, self.detail = env_id, op, detail


def reset_env(env: gym.Env, seed: int | None = None) -> tuple[Any, dict]:
    obs, info = env.reset(seed=seed)
    return copy_tree(obs), info


def step_env(env: gym.Env, action: Any) -> StepOut:
    """One step with same-step autoreset; the NaN/inf check runs here, in the lane or worker."""
    obs, reward, terminated, truncated, info = env.step(action)
    obs = copy_tree(obs)
    cost = getattr(env.unwrapped, "virtual_step_cost", 0.0)
    reward = float(reward)
    finite = math.isfinite(reward) and all_finite(obs)
    if terminated or truncated:
        final_obs, final_info = obs, info
        obs, info = reset_env(env)
        return StepOut(obs, reward, bool(terminated), bool(truncated), info, final_obs, final_info, cost, finite)
    return StepOut(obs, reward, False, False, info, None, None, cost, finite)


def single_spaces(env: gym.Env | gym.vector.VectorEnv) -> tuple[gym.Space, gym.Space]:
    """The observation and action spaces of one env, also when ``env`` is a vector env."""
    if isinstance(env, gym.vector.VectorEnv):
        return env.single_observation_space, env.single_action_space
    return env.observation_space, env.action_space


def close_quietly(env: gym.Env) -> None:
    """Close an env that is being replaced or shut down; its own errors no longer matter."""
    try:
        env.close()
    except Exception:
        pass


def describe(exc: BaseException) -> str:
    """``"TypeName: message"`` for an env's exception, as :class:`EnvStepError` reports it."""
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


class SimPool(ABC):
    """An awaitable home for ``num_envs`` envs built by ``env_fn(i)``."""

    backend: SimBackend
    resizable = False

    def __init__(self, env_fn: EnvFn, num_envs: int):
        self.env_fn = env_fn
        self.num_envs = num_envs
        self.observation_space: gym.Space | None = None
        self.action_space: gym.Space | None = None

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def reset(self, env_id: int, seed: int | None = None) -> tuple[Any, dict]: ...

    @abstractmethod
    async def step(self, env_id: int, action: Any) -> StepOut: ...

    @abstractmethod
    async def rebuild(self, env_id: int) -> None:
        """Close env ``env_id`` (ignoring its errors) and build it anew from ``env_fn``."""

    @abstractmethod
    def close(self) -> None:
        """Release every thread, process and env. Safe to call twice."""

    @property
    def size(self) -> int:
        return 1

    def resize(self, n: int) -> None:
        raise ValueError(f"the {self.backend.value} sim backend has a fixed size ({self.size})")
