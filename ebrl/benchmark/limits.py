"""The physical limit of a suite's case: each stage alone with the whole machine.

Simulation with every core, generation at its best batch, training alone; efficiency is
an achieved end-to-end rate over the bottleneck stage's capacity. On a CPU host the stages
time-share the same cores, so ``shared_cpu_bound_steps_per_s`` (the serial bound) is the
tighter reference there.
"""

from __future__ import annotations

import os
import threading
import time
import numpy as np

from ebrl.benchmark.spec import Suite
from ebrl.spaces import batch_of_one, copy_tree, stack


def _step_envs(env_fn, ids: list[int], seconds: float, counter: list[int], slot: int) -> None:
    envs = [env_fn(i) for i in ids]
    for k, env in enumerate(envs):
        env.reset(seed=ids[k])
        env.action_space.seed(ids[k])
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for env in envs:
            _, _, term, trunc, _ = env.step(env.action_space.sample())
            if term or trunc:
                env.reset()
            n += 1
    counter[slot] = n
    for env in envs:
        env.close()


BUILD_MARGIN_S = 300.0  # a child's env builds, beyond its stepping time


def _proc_entry(env_fn, ids, seconds, queue):
    counter = [0]
    _step_envs(env_fn, ids, seconds, counter, 0)
    queue.put(counter[0])


def sim_capacity(env_fn, num_envs: int, seconds: float) -> float:
    """Env steps/s of simulation alone with the whole machine: the better of one process per
    core (CPU-bound envs) and one thread per env (envs that release the GIL while stepping)."""
    from ebrl.runtime.children import child_context, helpers_scope, portable, start

    cpus = os.cpu_count() or 1
    with helpers_scope():  # a fork server these children need ends with them
        ctx, _ = child_context(None)  # fork-safe, as the runtime's own children
        queue = ctx.Queue()
        shares = [list(range(w, num_envs, cpus)) for w in range(min(cpus, num_envs))]
        procs = [ctx.Process(target=_proc_entry, args=(portable(env_fn, ctx), ids, seconds, queue)) for ids in shares]
        try:
            for p in procs:
                start(p, ctx)
            # the envs' builds and the stepping, with a generous margin: nothing waits for ever
            by_process = sum(queue.get(timeout=seconds + BUILD_MARGIN_S) for _ in procs) / seconds
        finally:
            for p in procs:
                if p.pid is not None:
                    p.join(1.0)
                    if p.is_alive():
                        p.kill()
                        p.join()
    counter = [0] * num_envs
    threads = [threading.Thread(target=_step_envs, args=(env_fn, [i], seconds, counter, i)) for i in range(num_envs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    by_thread = sum(counter) / seconds
    return max(by_process, by_thread)


def generation_capacity(suite: Suite, env_fn, seed: int = 0) -> tuple[float, int]:
    """Actions/s of the policy alone at its best batch size (batch sizes up to num_envs)."""
    env = env_fn(0)
    policy = suite.policy_fn(env.observation_space, env.action_space, seed)
    obs, _ = env.reset(seed=seed)
    env.close()
    best = (0.0, 1)
    for size in sorted({1, 4, 16, suite.num_envs}):
        batch = stack([obs] * size)
        policy.act(batch)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 0.3:
            policy.act(batch)
            n += 1
        rate = n * size / (time.perf_counter() - t0)
        best = max(best, (rate, size))
    return best


def training_capacity(suite: Suite, env_fn, seed: int = 0) -> float:
    """Env steps/s the algorithm trains on alone (one update on a batch of num_envs x T steps)."""
    from ebrl.runtime.learner_process import update_once
    from ebrl.runtime.collate import collate
    from ebrl.runtime.fields import transition_fields
    from ebrl.runtime.rollout import RolloutQueue
    from ebrl.runtime.sim.block import Block
    from ebrl.runtime.stats import RunStats

    env = env_fn(0)
    policy = suite.policy_fn(env.observation_space, env.action_space, seed)
    algo = suite.algo_fn(seed)
    n, T = suite.num_envs, suite.segment_len
    rollout = RolloutQueue(n, T, n, 0, RunStats(), transition_fields(env.observation_space, env.action_space))
    obs, _ = env.reset(seed=seed)
    for s in range(n):  # one env plays every segment in turn, recorded as the runtime records it
        ids = np.array([s])
        rollout.set_obs(ids, batch_of_one(obs))
        for _ in range(T):
            act = policy.act(rollout.current_obs(ids))
            nxt, r, term, trunc, _ = env.step(act.env_actions[0])
            finals = {0: copy_tree(nxt)} if trunc and not term else {}
            if term or trunc:
                nxt = env.reset()[0]
            rollout.begin(ids, act)
            rollout.record(Block(ids, batch_of_one(nxt), np.array([r]), np.array([term]), np.array([trunc]),
                                 np.ones(1, bool), np.full(1, -1, np.int8), finals))
        obs = nxt
    env.close()
    slots = list(rollout.closed)
    update_once(policy, algo, collate(rollout, slots, 0))  # warm-up: optimiser state, lazy imports
    t0 = time.perf_counter()
    update_once(policy, algo, collate(rollout, slots, 1))
    return n * T / (time.perf_counter() - t0)


def physical_limit(suite: Suite, env_fn, quick: bool) -> dict:
    sim = sim_capacity(env_fn, suite.num_envs, 0.5 if quick else 5.0)
    gen, gen_batch = generation_capacity(suite, env_fn)
    train = training_capacity(suite, env_fn)
    caps = {"sim": sim, "generation": gen, "training": train}
    bottleneck = min(caps, key=caps.get)
    return {"capacity_steps_per_s": caps, "bottleneck": bottleneck, "bottleneck_steps_per_s": caps[bottleneck],
            "generation_best_batch": gen_batch,
            # every stage time-shares the same cores on a CPU host: the serial bound is tighter
            "shared_cpu_bound_steps_per_s": 1.0 / sum(1.0 / c for c in caps.values())}
