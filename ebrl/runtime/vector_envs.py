"""Vectorised envs: one simulator stepping many envs at once (a GPU simulator such as ManiSkill,
or any gymnasium ``VectorEnv``), hosted as one unit of the sim pool.

With ``sim.vector_size = V > 1``, ``env_fn(k)`` builds vector env ``k``: a
``gymnasium.vector.VectorEnv`` of ``V`` envs, which are envs ``k*V ... k*V + V-1`` of the run.
Each vector env is one unit of the sim pool: one generation request for its ``V`` observations,
one simulator call for its ``V`` actions, whose reply is one block of ``V`` rows, each recorded in
its env's own segment. Vector envs never wait for each other under the ``async`` schedule; inside one, the
simulator itself is the barrier.

A vector env must reset its finished envs in the step that ends them (gymnasium's
``AutoresetMode.SAME_STEP``, with ``infos["final_obs"]``/``["final_info"]``) or not at all
(``DISABLED``: the runtime then resets the finished rows with ``options={"reset_mask": mask}``).
gymnasium's default, ``NEXT_STEP``, is refused: its step after an episode's end is a reset that
ignores the action, so the runtime would record a transition that never happened.

    >>> import gymnasium as gym
    >>> from ebrl.runtime.vector_envs import reset_vector_env, step_vector_env
    >>> venv = gym.make_vec("CartPole-v1", num_envs=3, vectorization_mode="sync",
    ...                     vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP})
    >>> obs, _ = reset_vector_env(venv, [0, 1, 2])
    >>> sorted(obs), obs[0].shape
    ([0, 1, 2], (4,))
    >>> out = step_vector_env(venv, np.array([0, 1, 0]))
    >>> out.obs.shape, out.terminated.tolist()
    ((3, 4), [False, False, False])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np

from ebrl.runtime.sim_types import SUCCESS_KEYS, Block, success_flag
from ebrl.spaces import all_finite, copy_tree, finite_rows, index, tree_map, unstack, write

SAME_STEP, DISABLED = gym.vector.AutoresetMode.SAME_STEP, gym.vector.AutoresetMode.DISABLED


def check_vector_env(venv: Any, index: int, vector_size: int) -> None:
    """Refuse what cannot be hosted, naming what to change."""
    if not isinstance(venv, gym.vector.VectorEnv):
        raise TypeError(f"sim.vector_size={vector_size} makes env_fn(k) build a vector env of that many envs "
                        f"(a gymnasium.vector.VectorEnv); env_fn({index}) returned {type(venv).__name__}")
    if venv.num_envs != vector_size:
        raise ValueError(f"env_fn({index}) built a VectorEnv of {venv.num_envs} envs; "
                         f"sim.vector_size is {vector_size}")
    mode = autoreset_mode(venv)
    if mode not in (SAME_STEP, DISABLED):
        raise ValueError(f"env_fn({index}) built a VectorEnv with autoreset_mode={mode}: the runtime needs "
                         "AutoresetMode.SAME_STEP or DISABLED (NEXT_STEP spends a step on each reset); e.g. "
                         "gym.make_vec(..., vector_kwargs={'autoreset_mode': gym.vector.AutoresetMode.SAME_STEP})")


def autoreset_mode(venv: gym.vector.VectorEnv) -> gym.vector.AutoresetMode:
    mode = venv.metadata.get("autoreset_mode", gym.vector.AutoresetMode.NEXT_STEP)
    return gym.vector.AutoresetMode(mode) if isinstance(mode, str) else mode


def row_info(infos: dict, i: int) -> dict:
    """Env ``i``'s own info from gymnasium's vector infos (values batched, ``_key`` masks)."""
    out = {}
    for key, value in infos.items():
        if key.startswith("_") or key in ("final_obs", "final_info"):
            continue
        mask = infos.get("_" + key)
        if mask is not None and not mask[i]:
            continue
        out[key] = row_info(value, i) if isinstance(value, dict) else value[i]
    return out


def _vector_cost(venv: gym.vector.VectorEnv) -> float:
    """Declared virtual-time cost of the last step: the vector env's own, or its slowest env's."""
    cost = getattr(venv, "virtual_step_cost", None)
    if cost is not None:
        return float(cost)
    return max((getattr(e.unwrapped, "virtual_step_cost", 0.0) for e in getattr(venv, "envs", ())), default=0.0)


def reset_vector_env(venv: gym.vector.VectorEnv, seed: list[int | None] | dict[int, int | None] | None = None
                    ) -> tuple[dict[int, Any], dict[int, dict]]:
    """Reset every env (``seed`` a list, one per env, or None) or some (``seed`` = ``{row: seed}``).

    Returns ``({row: obs}, {row: info})`` for the rows that were reset.
    """
    n = venv.num_envs
    if isinstance(seed, dict):
        mask = np.zeros(n, bool)
        mask[list(seed)] = True
        seeds = [seed.get(i) for i in range(n)]
        obs, infos = venv.reset(seed=seeds, options={"reset_mask": mask})
        rows = sorted(seed)
    else:
        obs, infos = venv.reset(seed=seed)
        rows = range(n)
    obs = unstack(copy_tree(obs), n)
    return {i: obs[i] for i in rows}, {i: row_info(infos, i) for i in rows}


@dataclass(slots=True, eq=False)
class VectorStep(Block):
    """One step of every env of a vector env (same-step autoreset): a :class:`Block` of its rows
    (``ids`` ``0..n-1``; ``final_obs`` of every row whose episode ended; ``chunk_rewards``/
    ``chunk_steps`` None when the infos carry none), and the step's declared cost (virtual time)."""

    cost_s: float = 0.0


def _chunks(infos: dict, done: np.ndarray, same_step: bool) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Rows' ``chunk_rewards``/``chunk_steps`` (``ActionChunk``'s info), or ``(None, None)``.
    After a same-step autoreset an ended row's are in ``final_info`` (its info is the reset's)."""
    final = infos.get("final_info", {}) if same_step else {}
    parts = [(d, rows) for d, rows in ((infos, ~done if same_step else np.ones_like(done)), (final, done))
             if "chunk_steps" in d]
    if not parts:
        return None, None
    n = len(done)
    rewards = np.zeros((n, np.shape(parts[0][0]["chunk_rewards"])[1]), np.float32)
    steps = np.zeros(n, np.int64)
    for d, rows in parts:
        m = rows & np.asarray(d.get("_chunk_steps", np.ones(n, bool)), bool)
        rewards[m] = np.asarray(d["chunk_rewards"], np.float32)[m]
        steps[m] = np.asarray(d["chunk_steps"])[m]
    return rewards, steps


def step_vector_env(venv: gym.vector.VectorEnv, actions: Any) -> VectorStep:
    """One step of every env, as arrays with a row per env (same-step autoreset)."""
    n = venv.num_envs
    obs, rewards, terminated, truncated, infos = venv.step(actions)
    rewards = np.asarray(rewards, np.float64).reshape(n)
    terminated = np.asarray(terminated, bool).reshape(n)
    truncated = np.asarray(truncated, bool).reshape(n)
    done = terminated | truncated
    obs = copy_tree(obs)
    finite = finite_rows(obs, n) & np.isfinite(rewards)
    success = np.full(n, -1, np.int8)
    if infos:
        for key in SUCCESS_KEYS:
            if key in infos:
                mask = infos.get("_" + key, np.ones(n, bool))
                success = np.where(mask, np.asarray(infos[key]).astype(bool), success).astype(np.int8)
                break
    final_obs: dict[int, Any] = {}
    if done.any():
        if autoreset_mode(venv) is DISABLED:
            final_obs = {int(i): index(obs, int(i)) for i in np.flatnonzero(done)}
            reset_obs, _ = reset_vector_env(venv, {i: None for i in final_obs})
            obs = tree_map(np.copy, obs)
            for i, o in reset_obs.items():
                write(obs, i, o)
                finite[i] &= all_finite(o)
        else:  # SAME_STEP: the venv reset them already; infos are the new episodes'
            for i in np.flatnonzero(done):
                final_obs[int(i)] = copy_tree(infos["final_obs"][i])
                success[i] = success_flag(row_info(infos.get("final_info", {}), i))
                finite[i] &= all_finite(final_obs[int(i)])
    chunk_rewards, chunk_steps = _chunks(infos or {}, done, done.any() and autoreset_mode(venv) is not DISABLED)
    return VectorStep(np.arange(n), obs, rewards, terminated, truncated, finite, success, final_obs,
                      chunk_rewards=chunk_rewards, chunk_steps=chunk_steps, cost_s=_vector_cost(venv))
