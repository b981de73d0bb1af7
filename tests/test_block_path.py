"""The block path end to end: no barrier inside a worker's message, nothing pickled per step,
and no stall of the caller's event loop while the envs are built."""

import asyncio
import time

import gymnasium as gym
import numpy as np

import ebrl
import ebrl.runtime.sim.worker as sim_worker
import ebrl.runtime.sim.workers as sim_workers
from ebrl.telemetry.timeline import Timeline
from ebrl.testing import Latency, MockEnv, MockPolicy, NoopAlgo


def test_worker_mates_come_back_while_a_slow_env_steps(no_leaks):
    """One worker, env 0 steps in 40 ms, envs 1-3 in 1 ms, all in the same messages. With a reply
    per message (a barrier) every fast step would end when env 0's ends; streamed replies bring
    the fast envs back while env 0 is still stepping. The margin is 30 ms, so load cannot flip it."""
    timeline = Timeline()
    tr = ebrl.Trainer(lambda i: MockEnv(latency=Latency.constant(0.040 if i == 0 else 0.001)), MockPolicy(act_dim=4),
                      NoopAlgo(), ebrl.RunConfig(num_envs=4, segment_len=8, total_env_steps=160,
                                                 sim={"backend": "process", "num_workers": 1}))
    res = ebrl.run_sync(tr, timeline=timeline)
    assert res.accounting_ok() and res.sim_backend == "process"
    sims = [(lane, t0, t1) for lane, name, t0, t1, _ in timeline.events if name == "sim"]
    slow = [(t0, t1) for lane, t0, t1 in sims if lane == "env 0"]
    fast_ends = [t1 for lane, _, t1 in sims if lane != "env 0"]
    inside = sum(any(a < t < b - 0.030 for a, b in slow) for t in fast_ends)
    assert inside >= 0.5 * len(fast_ends), (inside, len(fast_ends))


class DictEnv(gym.Env):
    """Pixels and state, like every pixel env of the registry."""

    observation_space = gym.spaces.Dict({"pixels": gym.spaces.Box(0, 255, (16, 16, 3), np.uint8),
                                         "state": gym.spaces.Box(-1.0, 1.0, (3,), np.float32)})
    action_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)

    def __init__(self):
        self.t = 0

    def _obs(self):
        return {"pixels": np.full((16, 16, 3), self.t % 256, np.uint8), "state": np.full(3, 0.5, np.float32)}

    def reset(self, *, seed=None, options=None):
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        return self._obs(), 1.0, False, self.t >= 20, {"is_success": self.t == 20}


class CountingPickle:
    def __init__(self, real):
        self.real, self.dumps_calls, self.loads_calls = real, 0, 0
        self.HIGHEST_PROTOCOL = real.HIGHEST_PROTOCOL

    def dumps(self, *a, **k):
        self.dumps_calls += 1
        return self.real.dumps(*a, **k)

    def loads(self, *a, **k):
        self.loads_calls += 1
        return self.real.loads(*a, **k)


def test_a_dict_observation_run_pickles_nothing_per_step(monkeypatch, no_leaks):
    """4000 steps of a pixels+state env on worker processes: the parent pickles and unpickles only
    the start-up and reset messages (a few per worker), however many steps run; the episodes'
    success flags still arrive (through shared-memory flags)."""
    counter = CountingPickle(sim_workers.pickle)
    for module in (sim_workers, sim_worker):  # the host's pickles and its worker links'
        monkeypatch.setattr(module, "pickle", counter)
    tr = ebrl.Trainer(lambda i: DictEnv(), MockPolicy(act_dim=2), NoopAlgo(),
                      ebrl.RunConfig(num_envs=8, segment_len=16, total_env_steps=4000,
                                     sim={"backend": "process", "num_workers": 2}))
    res = ebrl.run_sync(tr)
    assert res.accounting_ok() and res.env_steps == 4000
    assert res.episodes >= 190 and res.success_at_end == 1.0
    assert counter.dumps_calls + counter.loads_calls <= 6 * 2, (counter.dumps_calls, counter.loads_calls)


class SlowToBuild(MockEnv):
    def __init__(self):
        time.sleep(0.05)  # like loading a model file
        super().__init__()


def test_building_the_envs_does_not_stall_the_callers_event_loop(no_leaks):
    """16 envs that take 50 ms each to build: on the loop that would be an 800 ms stall of the
    caller's other tasks; run() builds them in a private thread, so a ticker keeps ticking."""
    async def main():
        gaps, last = [], time.perf_counter()

        async def ticker():
            nonlocal last
            while True:
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        tr = ebrl.Trainer(lambda i: SlowToBuild(), MockPolicy(act_dim=4), NoopAlgo(),
                          ebrl.RunConfig(num_envs=16, segment_len=8, total_env_steps=256,
                                         sim={"backend": "thread", "num_threads": 4}))
        res = await ebrl.run(tr)
        tick.cancel()
        return res, max(gaps)

    res, worst = asyncio.run(main())
    assert res.accounting_ok()
    assert worst < 0.4, worst


def test_the_rollout_owns_each_transition_from_the_action_to_the_record():
    """begin() keeps the behaviour rows of a batch slice for the envs it serves; record(block)
    stores each env's step with its own behaviour data, whatever order the block comes back in."""
    from ebrl.policies.base import ActResult
    from ebrl.runtime.collate import collate
    from ebrl.runtime.fields import transition_fields
    from ebrl.runtime.rollout import RolloutQueue
    from ebrl.runtime.sim import Block
    from ebrl.runtime.stats import RunStats

    box = gym.spaces.Box(-np.inf, np.inf, (1,), np.float32)
    rollout = RolloutQueue(4, 1, 4, 0, RunStats(), transition_fields(box, box))
    rollout.set_obs(np.arange(4), np.arange(4, dtype=np.float32)[:, None])
    acts = np.arange(5, dtype=np.float32)[:, None] * 10  # a batch of 5 rows; envs 2 and 0 got rows 1 and 2
    result = ActResult(acts, acts, np.arange(5, dtype=np.float32), -np.arange(5, dtype=np.float32))
    rollout.begin(np.array([2, 0]), result, 1, 3, version=7)
    rollout.begin(np.array([1, 3]), result, 3, 5, version=8)
    block = Block(np.array([0, 3, 2, 1]), np.full((4, 1), 9, np.float32), np.array([0.5, 3.5, 2.5, 1.5]),
                  np.zeros(4, bool), np.zeros(4, bool), np.ones(4, bool), np.full(4, -1, np.int8))
    rollout.record(block)  # one step each closes every segment (T = 1)
    batch = collate(rollout, list(rollout.closed), 8)
    env_of = rollout.slot_env[list(rollout.closed)]
    row = {int(e): k for k, e in enumerate(env_of)}
    for env, r, version in ((2, 1, 7), (0, 2, 7), (1, 3, 8), (3, 4, 8)):
        k = row[env]
        assert float(batch.actions[k, 0, 0]) == 10 * r and float(batch.logprobs[k, 0]) == r
        assert float(batch.values[k, 0]) == -r and int(batch.versions[k, 0]) == version
        assert float(batch.obs[k, 0, 0]) == env and float(batch.rewards[k, 0]) == env + 0.5
    assert np.all(rollout.obs == 9)  # the next observations replaced the current ones
