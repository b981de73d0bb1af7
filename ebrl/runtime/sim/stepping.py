"""Stepping one unit, the function every host runs: the inline host on the event loop, a lane
in its thread, a worker in its process (as PufferLib's workers each run a ``Serial``).

A unit is one env, or one vector env of ``V`` envs (``sim.vector_size``, e.g. ManiSkill on a
GPU): envs ``k*V ... k*V + V-1`` of the run, whose reply is one block of ``V`` rows.

Every unit resets an env in the same call as the step that ends its episode (gymnasium's
``AutoresetMode.SAME_STEP``), ``final_obs`` keeping the ended episode's last observation. A vector
env must do so itself, or not at all (``DISABLED``: its finished rows are reset here). Gymnasium's
default, ``NEXT_STEP``, is refused: its step after an episode's end ignores the action, so the
runtime would record a transition that never happened.

    >>> import gymnasium as gym
    >>> venv = gym.make_vec("CartPole-v1", num_envs=3, vectorization_mode="sync",
    ...                     vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP})
    >>> obs, _ = reset_unit(venv, [0, 1, 2], vector_size=3)
    >>> sorted(obs), obs[0].shape
    ([0, 1, 2], (4,))
"""

from __future__ import annotations

import contextlib
import math
import traceback
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np

from ebrl.runtime.errors import EnvStepError
from ebrl.runtime.sim.block import StepRows
from ebrl.spaces import all_finite, copy_tree, finite_rows, index, unstack
from ebrl.spaces import write as write_rows

EnvFn = Callable[[int], gym.Env]
SUCCESS_KEYS = ("is_success", "success")  # the info keys read as an episode's success flag
SAME_STEP, DISABLED = gym.vector.AutoresetMode.SAME_STEP, gym.vector.AutoresetMode.DISABLED


def step_unit(env: gym.Env, rows: StepRows, unit: int, vector_size: int = 1, write=None) -> float:
    """Step unit ``unit`` with the actions in its rows and ``write`` the results there (default
    ``rows.write``), NaN/inf checked here, where the step runs. ``rows.reset_seed`` seeds the
    autoreset of an env whose episode ends. Returns the step's declared cost (virtual time)."""
    write = write or rows.write
    if vector_size == 1:
        return _step_env(env, rows, unit, write)
    ids = np.arange(unit * vector_size, unit * vector_size + vector_size)
    return _step_vector(env, rows, ids, write)


def _step_env(env: gym.Env, rows: StepRows, i: int, write) -> float:
    obs, reward, terminated, truncated, info = env.step(_row(rows.act, i))
    cost = getattr(env.unwrapped, "virtual_step_cost", 0.0)  # the step's, before a reset changes it
    obs = copy_tree(obs)
    reward = float(reward)
    finite = math.isfinite(reward) and all_finite(obs)
    final = {}
    if terminated or truncated:  # the next episode's first observation comes back with this step
        final = {0: obs}
        seed = int(rows.reset_seed[i]) - 1
        obs, _ = reset_env(env, seed if seed >= 0 else None)  # the step's info, not the reset's, is read below
        finite = finite and all_finite(obs)
    write(i, obs, reward, bool(terminated), bool(truncated), finite, success_flag(info), final,
          _chunk(info, rows) if rows.chunk_steps is not None else None)
    return cost


def _row(tree: Any, i: int) -> Any:
    # a copy: an env may keep its action, and a view would pin (shared) rows rewritten by the next step
    return {k: _row(v, i) for k, v in tree.items()} if isinstance(tree, dict) else tree[i].copy()


def _chunk(info: dict, rows: StepRows) -> tuple[Any, int] | None:
    """A plain env's ``ActionChunk`` info as ``(chunk_rewards, chunk_steps)``; None: one step."""
    n = info.get("chunk_steps")
    if n is None:
        return None
    width, rewards = rows.columns["chunk_rewards"].shape[1], np.asarray(info["chunk_rewards"], np.float32)
    if rewards.shape != (width,) or not 1 <= n <= len(rewards):
        raise ValueError(f"info['chunk_rewards'] of shape {rewards.shape} with chunk_steps={n}: expected "
                         f"{width} rewards (zero-padded) and 1 <= chunk_steps <= that")
    return rewards, n


def success_flag(info: dict) -> int:
    """An info dict's success flag (``is_success`` or ``success``): 1, 0, or -1 if it has none."""
    for key in SUCCESS_KEYS:
        if key in info:
            return int(bool(info[key]))
    return -1


def reset_env(env: gym.Env, seed: int | None = None) -> tuple[Any, dict]:
    obs, info = env.reset(seed=seed)
    return copy_tree(obs), info


def reset_unit(env: gym.Env, seed: Any, vector_size: int = 1) -> tuple[Any, Any]:
    """Reset a unit: a plain env's ``(obs, info)``; a vector env takes a list of seeds (every row)
    or ``{row: seed}`` (some rows) and returns ``({row: obs}, {row: info})``."""
    if vector_size == 1:
        return reset_env(env, seed)
    n = env.num_envs
    if isinstance(seed, dict):
        mask = np.isin(np.arange(n), list(seed))
        obs, infos = env.reset(seed=[seed.get(i) for i in range(n)], options={"reset_mask": mask})
        rows = sorted(seed)
    else:
        obs, infos = env.reset(seed=seed)
        rows = range(n)
    obs = unstack(copy_tree(obs), n)
    return {i: obs[i] for i in rows}, {i: row_info(infos, i) for i in rows}


def build_unit(env_fn: EnvFn, unit: int, vector_size: int = 1) -> gym.Env:
    """``env_fn(unit)``, failing as the unit's :class:`EnvStepError`; a vector env that cannot be hosted
    is refused with TypeError or ValueError (a configuration error, not a fault to retry)."""
    try:
        env = env_fn(unit)
    except Exception as exc:
        raise EnvStepError(unit, "env_fn", describe(exc)) from exc
    if vector_size > 1:
        try:
            check_vector_env(env, unit, vector_size)
        except (TypeError, ValueError):
            close_quietly(env)
            raise
    return env


def check_vector_env(venv: Any, unit: int, vector_size: int) -> None:
    """Refuse what cannot be hosted, naming what to change."""
    if not isinstance(venv, gym.vector.VectorEnv):
        raise TypeError(f"sim.vector_size={vector_size} makes env_fn(k) build a vector env of that many envs "
                        f"(a gymnasium.vector.VectorEnv); env_fn({unit}) returned {type(venv).__name__}")
    if venv.num_envs != vector_size:
        raise ValueError(f"env_fn({unit}) built a VectorEnv of {venv.num_envs} envs; "
                         f"sim.vector_size is {vector_size}")
    mode = autoreset_mode(venv)
    if mode not in (SAME_STEP, DISABLED):
        raise ValueError(f"env_fn({unit}) built a VectorEnv with autoreset_mode={mode}: the runtime needs "
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


def _step_vector(venv: gym.vector.VectorEnv, rows: StepRows, ids: np.ndarray, write) -> float:
    n = venv.num_envs
    obs, rewards, terminated, truncated, infos = venv.step(index(rows.act, ids))
    rewards = np.asarray(rewards, np.float64).reshape(n)
    terminated = np.asarray(terminated, bool).reshape(n)
    truncated = np.asarray(truncated, bool).reshape(n)
    done = terminated | truncated
    obs = copy_tree(obs)
    finite = finite_rows(obs, n) & np.isfinite(rewards)
    success = np.full(n, -1, np.int8)
    infos = infos or {}
    for key in SUCCESS_KEYS:
        if key in infos:
            mask = infos.get("_" + key, np.ones(n, bool))
            success = np.where(mask, np.asarray(infos[key]).astype(bool), success).astype(np.int8)
            break
    final_obs: dict[int, Any] = {}
    same_step = done.any() and autoreset_mode(venv) is not DISABLED
    if done.any():
        if not same_step:  # DISABLED: the finished rows are reset here
            final_obs = {int(i): copy_tree(index(obs, int(i))) for i in np.flatnonzero(done)}
            reset_obs, _ = reset_unit(venv, {i: None for i in final_obs}, n)
            for i, o in reset_obs.items():
                write_rows(obs, i, o)
                finite[i] &= all_finite(o)
        else:  # SAME_STEP: the venv reset them already; infos are the new episodes'
            for i in np.flatnonzero(done):
                final_obs[int(i)] = copy_tree(infos["final_obs"][i])
                success[i] = success_flag(row_info(infos.get("final_info", {}), i))
                finite[i] &= all_finite(final_obs[int(i)])
    chunks = _vector_chunks(infos, done, same_step) if rows.chunk_steps is not None else None
    write(ids, obs, rewards, terminated, truncated, finite, success, final_obs, chunks)
    return _vector_cost(venv)


def _vector_chunks(infos: dict, done: np.ndarray, same_step: bool) -> tuple[np.ndarray, np.ndarray] | None:
    """Rows' ``chunk_rewards``/``chunk_steps`` (``ActionChunk``'s info), or None. After a
    same-step autoreset an ended row's are in ``final_info`` (its info is the reset's)."""
    final = infos.get("final_info", {}) if same_step else {}
    parts = [(d, rows) for d, rows in ((infos, ~done if same_step else np.ones_like(done)), (final, done))
             if "chunk_steps" in d]
    if not parts:
        return None
    n = len(done)
    rewards = np.zeros((n, np.shape(parts[0][0]["chunk_rewards"])[1]), np.float32)
    steps = np.zeros(n, np.int64)
    for d, rows in parts:
        m = rows & np.asarray(d.get("_chunk_steps", np.ones(n, bool)), bool)
        rewards[m] = np.asarray(d["chunk_rewards"], np.float32)[m]
        steps[m] = np.asarray(d["chunk_steps"])[m]
    return rewards, steps


def _vector_cost(venv: gym.vector.VectorEnv) -> float:
    """Declared virtual-time cost of the last step: the vector env's own, or its slowest env's."""
    cost = getattr(venv, "virtual_step_cost", None)
    if cost is not None:
        return float(cost)
    return max((getattr(e.unwrapped, "virtual_step_cost", 0.0) for e in getattr(venv, "envs", ())), default=0.0)


def single_spaces(env: gym.Env | gym.vector.VectorEnv) -> tuple[gym.Space, gym.Space]:
    """The observation and action spaces of one env, also when ``env`` is a vector env."""
    if isinstance(env, gym.vector.VectorEnv):
        return env.single_observation_space, env.single_action_space
    return env.observation_space, env.action_space


def close_quietly(env: gym.Env | None) -> None:
    """Close an env that is being replaced or shut down; its own errors no longer matter."""
    if env is not None:
        with contextlib.suppress(Exception):
            env.close()


def describe(exc: BaseException) -> str:
    """``"TypeName: message"`` for an env's exception, as :class:`EnvStepError` reports it."""
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()
