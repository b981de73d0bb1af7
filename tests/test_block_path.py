"""The block path end to end: no barrier inside a worker's message, nothing pickled per step,
and no stall of the caller's event loop while the envs are built."""

import asyncio
import threading
import time

import gymnasium as gym
import numpy as np

import ebrl
import ebrl.runtime.sim.worker as sim_worker
import ebrl.runtime.sim.workers as sim_workers
from ebrl.runtime.sim.block import Outbox
from ebrl.testing import Latency, MockEnv, MockPolicy, NoopAlgo


def test_worker_mates_come_back_while_a_slow_env_steps(monkeypatch, no_leaks):
    """One worker, env 0 steps in 40 ms, envs 1-3 in 1 ms, all in the same messages. With a reply
    per message (a barrier) every fast step would come back with env 0's; streamed replies bring
    the fast envs back while env 0 is still stepping. Asserted on the order of the replies, which
    no load changes: a block holding env 0 holds no other env once env 0 has been timed, and fast
    envs reach the driver while a step of env 0 is out."""
    out, replies = set(), []  # env 0's step in flight; (ids, whether env 0's step was out) per reply
    submit, put = sim_workers.WorkerHost.submit, Outbox.put

    def submitting(host, ids, actions):
        submit(host, ids, actions)
        out.update(np.asarray(ids).tolist())

    def putting(box, block):
        ids = block.ids.tolist()
        replies.append((ids, 0 in out))
        out.difference_update(ids)
        put(box, block)

    monkeypatch.setattr(sim_workers.WorkerHost, "submit", submitting)
    monkeypatch.setattr(Outbox, "put", putting)
    tr = ebrl.Trainer(lambda i: MockEnv(latency=Latency.constant(0.040 if i == 0 else 0.001)), MockPolicy(act_dim=4),
                      NoopAlgo(), ebrl.RunConfig(num_envs=4, segment_len=8, total_env_steps=160,
                                                 sim={"backend": "process", "num_workers": 1}))
    res = ebrl.run_sync(tr)
    assert res.accounting_ok() and res.sim_backend == "process"
    with_0 = [k for k, (ids, _) in enumerate(replies) if 0 in ids]
    assert all(replies[k][0] == [0] for k in with_0[1:]), replies  # no fast env ever waited in env 0's reply
    assert any(was_out for ids, was_out in replies if ids and 0 not in ids), replies  # they came back meanwhile


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


class Ticks:
    """The caller's ticker: ``count`` goes up each time the event loop runs it."""

    count = 0
    deadline = float("inf")


class WaitsForATick(MockEnv):
    """An env whose build (a model file loading, say) ends only once the caller's event loop has
    ticked during it, or at ``Ticks.deadline``: it records which, and in which thread it was built."""

    builds: list[tuple[bool, int]] = []

    def __init__(self):
        seen = Ticks.count
        while Ticks.count == seen and time.monotonic() < Ticks.deadline:
            time.sleep(0.001)
        WaitsForATick.builds.append((Ticks.count != seen, threading.get_ident()))
        super().__init__()


def test_building_the_envs_does_not_stall_the_callers_event_loop(no_leaks):
    """16 envs whose builds each end only after the caller's loop has run a ticker task: built on
    the loop, none would see a tick (each would wait out the deadline, a hang guard); run()
    builds them in a private thread, so the ticker ticks through every build. An order, not a
    gap length: how long the loop may go without a tick is the controller bench's "loop block"
    (bench/suites/controller.py)."""
    WaitsForATick.builds = []
    Ticks.count, Ticks.deadline = 0, time.monotonic() + 30.0

    async def main():
        async def ticker():
            while True:
                await asyncio.sleep(0.005)
                Ticks.count += 1

        tick = asyncio.create_task(ticker())
        tr = ebrl.Trainer(lambda i: WaitsForATick(), MockPolicy(act_dim=4), NoopAlgo(),
                          ebrl.RunConfig(num_envs=16, segment_len=8, total_env_steps=256,
                                         sim={"backend": "thread", "num_threads": 4}))
        res = await ebrl.run(tr)
        tick.cancel()
        return res, threading.get_ident()

    res, loop_thread = asyncio.run(main())
    assert res.accounting_ok()
    built = WaitsForATick.builds
    assert len(built) >= 16 and all(ticked for ticked, _ in built), built
    assert loop_thread not in {thread for _, thread in built}


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
