"""The peer EBRL is compared against: gymnasium's vector envs in a plain CleanRL-style PPO loop.

This is what most users run today. One ``SyncVectorEnv`` (every env stepped in turn, in this
process) or ``AsyncVectorEnv`` (one worker process per env, shared-memory observations) steps all
``num_envs`` envs in lockstep; the loop collects ``segment_len`` steps from each, builds one
:class:`ebrl.algos.Batch` ``[num_envs, segment_len]``, runs ``algo.update`` and repeats until
``total_env_steps``. Acting and training alternate: while PPO trains, no env steps, and every
vector step waits for the slowest env. The acting policy *is* the trained object (plain loops do
not copy it), so every action comes from the latest weights (policy lag 0).

Same-step autoreset (``AutoresetMode.SAME_STEP``): an episode that ends at step ``t`` returns the
next episode's first observation at once, and a time-limit end (truncated, not terminated)
bootstraps from ``info["final_obs"]``, exactly as EBRL's segments do. With the same env, policy,
algorithm and seeds, the "sync" peer ends with the same weights as EBRL's
``schedule="sync", max_policy_lag=0`` (tests/test_peers.py checks it).

Example (``bench/`` is not a package: load this file by path, or run from ``bench/peers/``)::

    from ebrl.algos import PPO
    from ebrl.policies import MLPPolicy
    from ebrl.testing import MockEnv
    from gym_vector import run_peer

    env_fn = lambda i: MockEnv(dim=3, episode_len=12)
    probe = env_fn(0)
    policy = MLPPolicy.from_spaces(probe.observation_space, probe.action_space, seed=0)
    out = run_peer("async", env_fn, policy, PPO(minibatch_size=64),
                   num_envs=4, segment_len=8, total_env_steps=96)
    print(out["env_steps"], out["updates"], round(out["steps_per_s"]))   # 96 3 ...
"""

from __future__ import annotations

import functools
import math
import time
from collections import deque

import gymnasium as gym
import numpy as np
import torch

from ebrl.algos import Batch

KINDS = {"sync": gym.vector.SyncVectorEnv, "async": gym.vector.AsyncVectorEnv}


def _alloc(space: gym.Space, lead: tuple[int, ...]):
    if isinstance(space, gym.spaces.Dict):
        return {k: _alloc(v, lead) for k, v in space.spaces.items()}
    return np.empty((*lead, *space.shape), space.dtype)


def _put(buf, t: int, x) -> None:
    if isinstance(buf, dict):
        for k, v in buf.items():
            v[t] = x[k]
    else:
        buf[t] = x


def _tensor(x):
    if isinstance(x, dict):
        return {k: _tensor(v) for k, v in x.items()}
    return torch.from_numpy(np.array(x))


def _stack(items: list, like):
    """Final observations of truncated steps, batched like the observation buffer."""
    if isinstance(like, dict):
        return {k: _stack([it[k] for it in items], v) for k, v in like.items()}
    return torch.from_numpy(np.stack([np.asarray(it, like.dtype) for it in items]) if items else like[0, :0].copy())


def run_peer(kind: str, env_fn, policy, algo, *, num_envs: int, segment_len: int, total_env_steps: int,
             seed: int = 0) -> dict:
    """Train ``policy`` with ``algo`` on ``num_envs`` copies of ``env_fn(i)`` (EBRL's convention:
    ``env_fn`` takes the env index), ``segment_len`` steps per env between updates, until at
    least ``total_env_steps`` env steps (whole iterations of ``num_envs * segment_len``).

    ``wall_s`` runs from building the vector env to closing it (training included), as EBRL's
    benchmarks time a whole ``run_sync``; ``rollout_s`` is acting plus stepping plus building the
    batch, ``train_s`` the time inside ``algo.update``.
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: must be one of {sorted(KINDS)}")
    N, T = int(num_envs), int(segment_len)
    if N < 1 or T < 1 or total_env_steps < 1:
        raise ValueError(f"num_envs={num_envs}, segment_len={segment_len} and total_env_steps={total_env_steps} "
                         f"must be >= 1")
    old_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as EBRL's default torch_threads=1
    returns: deque[float] = deque(maxlen=100)  # the last 100 finished episodes
    env_steps = updates = 0
    rollout_s = train_s = 0.0
    first_step = first_update = math.nan  # start-up, as EBRL reports it (RunResult.first_step_s)
    steps_at_first_update = 0
    t_start = time.perf_counter()
    envs = None
    try:
        envs = KINDS[kind]([functools.partial(env_fn, i) for i in range(N)],
                           autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
        obs, _ = envs.reset(seed=[seed + i for i in range(N)])
        obs_space = envs.single_observation_space
        # Per-step buffers, time-major as CleanRL: [T, N, ...]; the batch is [N, T].
        b_obs = _alloc(obs_space, (T, N))
        b_logp, b_val, b_rew = (np.empty((T, N), np.float32) for _ in range(3))
        b_term, b_trunc = np.empty((T, N), bool), np.empty((T, N), bool)
        b_act = None  # shaped by the first action
        ep_ret = np.zeros(N)

        while env_steps < total_env_steps:
            t0 = time.perf_counter()
            finals = []  # (env, step, final observation) of time-limit ends
            for t in range(T):
                out = policy.act(obs)
                if b_act is None:
                    b_act = np.empty((T, *np.shape(out.actions)), np.asarray(out.actions).dtype)
                _put(b_obs, t, obs)
                b_act[t], b_logp[t], b_val[t] = out.actions, out.logprobs, out.values
                obs, rew, term, trunc, info = envs.step(out.env_actions)
                if first_step != first_step:  # NaN: this is the first
                    first_step = time.perf_counter() - t_start
                b_rew[t], b_term[t], b_trunc[t] = rew, term, trunc
                for i in np.flatnonzero(trunc & ~term):
                    finals.append((i, t, info["final_obs"][i]))
                ep_ret += rew
                for i in np.flatnonzero(term | trunc):
                    returns.append(float(ep_ret[i]))
                    ep_ret[i] = 0.0
            finals.sort(key=lambda f: (f[0], f[1]))  # Batch order: by env, then step

            def nt(x):  # [T, N, ...] -> [N, T, ...] tensor (per key for dict observations)
                if isinstance(x, dict):
                    return {k: nt(v) for k, v in x.items()}
                return torch.from_numpy(np.ascontiguousarray(x.swapaxes(0, 1)))

            batch = Batch(
                obs=nt(b_obs), actions=nt(b_act), logprobs=nt(b_logp), values=nt(b_val), rewards=nt(b_rew),
                terminated=nt(b_term), truncated=nt(b_trunc), mask=torch.ones(N, T, dtype=torch.bool),
                versions=torch.full((N, T), updates, dtype=torch.int64),
                bootstrap_obs=_tensor(obs),
                final_obs=_stack([f[2] for f in finals], b_obs),
                final_index=torch.tensor([(f[0], f[1]) for f in finals], dtype=torch.int64).reshape(-1, 2),
                learner_version=updates)
            env_steps += N * T
            t1 = time.perf_counter()
            algo.update(policy, batch)
            updates += 1
            if updates == 1:
                first_update, steps_at_first_update = time.perf_counter() - t_start, env_steps
            rollout_s += t1 - t0
            train_s += time.perf_counter() - t1
    finally:
        if envs is not None:
            envs.close()  # joins AsyncVectorEnv's workers: none outlives the call
        torch.set_num_threads(old_threads)
    wall_s = time.perf_counter() - t_start
    steady_s = wall_s - first_update
    startup = {"first_step_s": first_step, "first_update_s": first_update,
               "steady_steps_per_s": (env_steps - steps_at_first_update) / steady_s if steady_s > 0 else math.nan}
    return {"peer": f"gym-{kind}", "env_steps": env_steps, "wall_s": wall_s,
            "steps_per_s": env_steps / wall_s, "rollout_s": rollout_s, "train_s": train_s,
            "rollout_steps_per_s": env_steps / rollout_s if rollout_s > 0 else math.nan,
            "updates": updates, **startup, "mean_return": float(np.mean(returns)) if returns else math.nan}
