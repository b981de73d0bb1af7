"""The runtime on real event loops (uvloop), real threads and real worker processes."""

import asyncio
import multiprocessing

import gymnasium as gym
import numpy as np
import pytest

import ebrl
from ebrl.testing import Latency, MockEnv, MockPolicy, NoopAlgo
from tests.conftest import ebrl_threads


def make_trainer(backend, total=2000, num_envs=8, latency=Latency.constant(0.0005), mode="sleep",
                 sim_inline_below_s=20e-6, **cfg):
    sim = {"backend": backend, "num_threads": 2, "num_workers": 2, "inline_below_s": sim_inline_below_s}
    return ebrl.Trainer(lambda i: MockEnv(latency=latency, latency_mode=mode), MockPolicy(act_dim=4), NoopAlgo(),
                        ebrl.RunConfig(num_envs=num_envs, segment_len=16, total_env_steps=total, sim=sim, **cfg))


async def test_running_loop_is_uvloop():
    import uvloop

    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)


@pytest.mark.parametrize("backend", ["inline", "thread", "process"])
@pytest.mark.parametrize("schedule", ["async", "sync", "pipelined"])
async def test_every_backend_and_schedule_completes_with_exact_accounting(backend, schedule, no_leaks):
    res = await ebrl.run(make_trainer(backend, schedule=schedule))
    assert res.sim_backend == backend
    assert res.env_steps == 2000 and res.trained == 2000 and res.accounting_ok()
    assert res.in_flight_at_stop == 0


async def test_cancel_from_outside_leaves_no_thread_task_or_process(no_leaks):
    task = asyncio.create_task(ebrl.run(make_trainer("thread", total=10**9)))
    await asyncio.sleep(0.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ebrl_threads() == []
    assert [t for t in asyncio.all_tasks() if t.get_name().startswith("ebrl-")] == []


async def test_cancel_with_worker_processes_reaps_them(no_leaks):
    task = asyncio.create_task(ebrl.run(make_trainer("process", total=10**9, mode="spin")))
    await asyncio.sleep(1.0)
    assert any(p.name.startswith("ebrl-sim-worker") for p in multiprocessing.active_children())
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_stop_event_finishes_cleanly_and_accounts_for_everything(no_leaks):
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.5, stop.set)
    res = await ebrl.run(make_trainer("thread", total=10**9), stop=stop)
    assert 0 < res.env_steps < 10**9
    assert res.accounting_ok()


async def test_env_failure_in_a_worker_process_is_rebuilt(no_leaks):
    built = multiprocessing.Value("i", 0)

    def env_fn(i):
        with built.get_lock():
            built.value += 1
            first_of_env0 = i == 0 and built.value <= 2
        return MockEnv(fail_at_step=10 if first_of_env0 else None)

    tr = ebrl.Trainer(env_fn, MockPolicy(act_dim=4), NoopAlgo(),
                      ebrl.RunConfig(num_envs=2, segment_len=8, total_env_steps=200, sim={"backend": "process"}))
    res = await ebrl.run(tr)
    assert res.env_failures == 1 and res.env_steps == 200 and res.accounting_ok()


def test_auto_backend_rule():
    from ebrl.config import SimConfig
    from ebrl.runtime.sim_pool import decide_backend

    cfg = SimConfig()
    assert decide_backend(5e-6, False, cfg, cpus=2) == "inline"
    assert decide_backend(1e-3, True, cfg, cpus=2) == "thread"
    assert decide_backend(1e-3, False, cfg, cpus=2) == "process"
    assert decide_backend(1e-3, False, cfg, cpus=1) == "thread"  # processes gain nothing on one core


async def test_auto_backend_measures_the_env():
    # costs far apart from the thresholds, so machine load cannot flip the choice
    cheap = await ebrl.run(make_trainer("auto", total=200, latency=Latency(), sim_inline_below_s=1e-3))
    assert cheap.sim_backend == "inline"
    spinning = await ebrl.run(make_trainer("auto", total=200, latency=Latency.constant(0.002), mode="spin"))
    assert spinning.sim_backend == "process"


async def test_bad_env_fn_reports_the_env_and_the_cause():
    def broken(i):
        raise FileNotFoundError("no assets here")

    tr = ebrl.Trainer(broken, MockPolicy(act_dim=4), NoopAlgo(), ebrl.RunConfig(num_envs=2, sim={"backend": "thread"}))
    with pytest.raises(ebrl.runtime.sim_pool.EnvStepError, match="env 0 failed in env_fn: FileNotFoundError: no assets"):
        await ebrl.run(tr)


def test_run_sync_uses_uvloop_and_gymnasium_envs_work(no_leaks):
    tr = ebrl.Trainer(lambda i: gym.make("CartPole-v1"), MockPolicy(act_dim=None, n_actions=2, random=True), NoopAlgo(),
                      ebrl.RunConfig(num_envs=4, segment_len=32, total_env_steps=1000))
    res = ebrl.run_sync(tr)
    assert res.env_steps == 1000 and res.episodes > 0 and res.accounting_ok()


@pytest.mark.parametrize("backend", ["thread", "process"])
async def test_nonfinite_is_detected_where_the_step_runs(backend, no_leaks):
    tr = ebrl.Trainer(lambda i: MockEnv(nan_at_step=20 if i == 1 else None), MockPolicy(act_dim=4), NoopAlgo(),
                      ebrl.RunConfig(num_envs=2, segment_len=8, total_env_steps=200, schedule="sync",
                                     sim={"backend": backend}, faults={"nonfinite": "drop"}))
    res = await ebrl.run(tr)
    # lockstep: no lag-deadline cuts, so env 1's open segment holds exactly steps 17-19 at the NaN step 20
    assert res.dropped["nonfinite"] == 1 + 3
    assert res.accounting_ok()


async def test_process_backend_carries_observations_larger_than_a_socket_buffer(no_leaks):

    class BigObs(MockEnv):
        """Dict observations of 300 kB: several socket buffers per message."""

        def __init__(self):
            super().__init__(dim=2, episode_len=5)
            self.observation_space = gym.spaces.Dict({"big": gym.spaces.Box(0, 255, (100, 1000, 3), np.uint8),
                                                      "state": self.observation_space})

        def _observe(self):
            return {"big": np.full((100, 1000, 3), self.steps % 255, np.uint8), "state": super()._observe()}

    tr = ebrl.Trainer(lambda i: BigObs(), MockPolicy(act_dim=2), NoopAlgo(),
                      ebrl.RunConfig(num_envs=4, segment_len=8, total_env_steps=64, sim={"backend": "process"}))
    res = await ebrl.run(tr)
    assert res.env_steps == 64 and res.episodes > 0 and res.accounting_ok()


@pytest.mark.parametrize("backend", ["inline", "thread", "process"])
async def test_envs_that_reuse_their_observation_array_are_recorded_correctly(backend):
    class InPlace(MockEnv):
        """Writes every observation into the same array, as some envs do."""

        def __init__(self):
            super().__init__(dim=1, episode_len=1000)
            self._buf = np.zeros(1, np.float32)

        def _observe(self):
            self._buf[0] = self.steps  # the observation is the step count
            return self._buf

    algo = NoopAlgo()
    tr = ebrl.Trainer(lambda i: InPlace(), MockPolicy(act_dim=1), algo,
                      ebrl.RunConfig(num_envs=1, segment_len=8, total_env_steps=16, sim={"backend": backend}))
    await ebrl.run(tr)
    obs = np.concatenate([b.obs[0, :, 0].numpy() for b in algo.batches])
    np.testing.assert_array_equal(obs, np.arange(16))  # each transition kept the observation it acted on
