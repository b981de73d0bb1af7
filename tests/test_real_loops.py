"""The runtime on real event loops (uvloop), real threads and real worker processes."""

import asyncio
import multiprocessing
import time

import gymnasium as gym
import numpy as np
import pytest

import ebrl
from ebrl.testing import Latency, MockEnv, MockPolicy, NoopAlgo, VersionedPolicy
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
    for _ in range(200):  # a fork server's first child (a pytest process that rendered before) takes seconds
        await asyncio.sleep(0.05)
        if any(p.name.startswith("ebrl-sim-worker") for p in multiprocessing.active_children()):
            break
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
            # run()'s inspection of env 0 is the first build, then the workers build envs 0 and 1 in either order
            first_of_env0 = i == 0 and built.value <= 3
        return MockEnv(fail_at_step=10 if first_of_env0 else None)

    tr = ebrl.Trainer(env_fn, MockPolicy(act_dim=4), NoopAlgo(),
                      ebrl.RunConfig(num_envs=2, segment_len=8, total_env_steps=200,
                                     sim={"backend": "process", "start_method": "fork"}))  # built: shared by the fork
    res = await ebrl.run(tr)
    assert res.env_failures == 1 and res.env_steps == 200 and res.accounting_ok()


def test_the_controllers_start_rule_picks_the_backend_and_lanes_from_the_probed_step():
    from ebrl.config import SimConfig
    from ebrl.runtime.resources.rules_start import START, sim_start
    from ebrl.runtime.probe import StepProfile

    def start(profile, cpus=2, num_envs=32, **sim):
        return {d.knob: d.new for d in sim_start(profile, SimConfig(**sim), num_envs, cpus)}

    busy, sleeping = StepProfile(1e-3, 1e-3, False), StepProfile(1e-3, 2e-5, False)
    assert start(StepProfile(5e-6, 5e-6, False)) == {"backend": "inline"}
    assert start(StepProfile(1e-3, 1e-3, True))["backend"] == "thread"  # declared
    assert start(busy) == {"backend": "process"}
    assert start(sleeping)["backend"] == "thread"  # measured: the step waits, threads overlap it
    assert start(busy, cpus=1)["backend"] == "thread"  # processes gain nothing on one core
    # lanes: one per env for envs that wait, one per core for busy ones, never more than the envs
    assert start(sleeping)["lanes"] == 32
    assert start(StepProfile(1e-3, 2.5e-4, True))["lanes"] == 8
    assert start(StepProfile(1e-3, 1e-3, True))["lanes"] == 2
    assert start(sleeping, num_envs=4)["lanes"] == 4
    assert start(sleeping, num_threads=3) == {"backend": "thread"}  # the user's lanes are kept
    assert {d.epoch for d in sim_start(sleeping, SimConfig(), 32, 2)} == {START}


async def test_auto_backend_measures_the_env():
    # costs far apart from the thresholds, so machine load cannot flip the choice
    cheap = await ebrl.run(make_trainer("auto", total=200, latency=Latency(), sim_inline_below_s=1e-3))
    assert cheap.sim_backend == "inline"
    spinning = await ebrl.run(make_trainer("auto", total=200, latency=Latency.constant(0.002), mode="spin"))
    assert spinning.sim_backend == "process"
    # the start decision that chose it is the run's first, with its reason
    first = spinning.decisions[0]
    assert (first["epoch"], first["knob"], first["old"], first["new"]) == (-1, "backend", "auto", "process")
    assert "GIL" in first["reason"]


class QuietSleeper(MockEnv):
    """A user's env that sleeps in its step and does not say it releases the GIL."""

    def __init__(self):
        super().__init__(latency=Latency.constant(0.002))
        self.metadata = {"render_modes": []}


async def test_auto_gives_an_env_that_waits_threads_and_a_lane_each():
    """Measured, not declared: the probe sees CPU time far under wall time (a 2 ms sleep) and
    picks threads, one lane per env; an explicit sim.num_threads is kept as set."""
    def trainer(**sim):
        return ebrl.Trainer(lambda i: QuietSleeper(), MockPolicy(act_dim=4), NoopAlgo(),
                            ebrl.RunConfig(num_envs=12, segment_len=8, total_env_steps=96, sim=sim))

    res = await ebrl.run(trainer())
    assert (res.sim_backend, res.sim_size) == ("thread", 12) and res.accounting_ok()
    res = await ebrl.run(trainer(num_threads=3))
    assert (res.sim_backend, res.sim_size) == ("thread", 3)


async def test_bad_env_fn_reports_the_env_and_the_cause():
    def broken(i):
        raise FileNotFoundError("no assets here")

    tr = ebrl.Trainer(broken, MockPolicy(act_dim=4), NoopAlgo(), ebrl.RunConfig(num_envs=2, sim={"backend": "thread"}))
    with pytest.raises(ebrl.runtime.errors.EnvStepError, match="env 0 failed in env_fn: FileNotFoundError: no assets"):
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


# ---------------------------------------------------------------- no barrier and lag bound, in real time

SLOW_S, FAST_S = 0.020, 0.001  # env 0's step vs the others' (slept: releases the GIL)


def sim_config(backend):
    return {"backend": "thread", "num_threads": 4} if backend == "thread" else {"backend": "process", "num_workers": 2}


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_no_barrier_on_real_loops_fast_envs_run_ahead_of_a_slow_one(backend, no_leaks):
    """Async, real time: env 0 steps in 20 ms, the others in 1 ms; nothing makes them wait for env 0.

    A barrier anywhere (the generator waiting for every env, the learner waiting for env 0's
    segment, a full queue nobody drains) would hold the fast envs near env 0's step count; with
    none, they run ~10x more steps. The assertion wants only 3x, so load cannot flip it. On the
    process backend env ``i`` lives in worker ``i % 2`` and a worker steps its envs one after
    another, so env 2 shares env 0's worker and its pace; envs 1 and 3 (the other worker) are
    the ones that must run ahead.
    """
    tr = ebrl.Trainer(lambda i: MockEnv(latency=Latency.constant(SLOW_S if i == 0 else FAST_S)), MockPolicy(act_dim=4),
                      NoopAlgo(), ebrl.RunConfig(num_envs=4, segment_len=16, total_env_steps=1200,
                                                 sim=sim_config(backend)))
    res = ebrl.run_sync(tr)
    assert res.sim_backend == backend and res.env_steps == 1200 and res.accounting_ok()
    fast = [1, 2, 3] if backend == "thread" else [1, 3]
    counts = res.steps_per_env
    assert min(counts[i] for i in fast) >= 3 * counts[0], counts


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_sync_on_real_loops_holds_every_env_to_the_slow_ones_pace(backend, no_leaks):
    """The contrast: the lockstep schedule steps every env once per round, whatever the latencies.

    Fails if the sync driver let an env skip a round or step twice in one (counts would differ).
    """
    tr = ebrl.Trainer(lambda i: MockEnv(latency=Latency.constant(SLOW_S if i == 0 else FAST_S)), MockPolicy(act_dim=4),
                      NoopAlgo(), ebrl.RunConfig(num_envs=4, segment_len=16, total_env_steps=200, schedule="sync",
                                                 sim=sim_config(backend)))
    res = ebrl.run_sync(tr)
    assert res.sim_backend == backend and res.env_steps == 200 and res.accounting_ok()
    assert res.steps_per_env == [50] * 4


class VersionBumpAlgo:
    """Checks every trained step against the weights that really acted (``VersionedPolicy``), then
    bumps the weights' version. Runs wherever the learner runs (a thread, or a child process),
    so it reports through the metrics dict that ``update`` returns (``RunResult.history``), under
    keys of its own: the runtime's row keys (its tag-based ``lag_max`` among them) win a clash."""

    def __init__(self, sleep_s: float):
        self.sleep_s = sleep_s  # training slower than rollout: the lag bound is under pressure

    def update(self, policy, batch):
        held = policy.weights_version  # the learner's weights, before this update
        acted = VersionedPolicy.acted_versions(batch)  # the weights that produced each action
        tags = batch.versions[batch.mask]  # the generator's version tags
        lags = held - acted
        time.sleep(self.sleep_s)
        policy.weights_version += 1
        return {"vb_held_version": held, "vb_learner_tag": batch.learner_version, "vb_steps": len(acted),
                "vb_lag_max": int(lags.max()), "vb_lag_min": int(lags.min()),
                "vb_tag_mismatch": int((acted != tags).sum())}


@pytest.mark.parametrize(("backend", "learner", "lag"), [
    *[("thread", learner, lag) for learner in ("thread", "process") for lag in (0, 1, 2)],
    ("process", "thread", 1),
    ("process", "process", 2),
])
def test_lag_bound_holds_against_the_weights_that_acted(backend, learner, lag, no_leaks):
    """max_policy_lag, measured from the actions themselves, not from the generator's tags.

    ``VersionedPolicy`` writes the version of the weights it holds into every action; the
    learner-side ``VersionBumpAlgo`` compares it with the version of the weights it trains.
    Fails if a trained step is older than ``max_policy_lag`` updates (a missed cut, a stale
    in-flight step not awaited, weights not reaching the generator), if a tag disagrees with
    the weights that acted (a tag taken before or after the weights swap), or if the learner's
    version counter drifts from its weights. With lag > 0 an update sleeps 100 ms, several times
    a rollout (4 envs x 8 steps of ~1-2 ms), so the queue fills and the lag must reach the bound:
    a test that never comes near it proves nothing. (Lag 0 pauses generation during updates and
    reaches its bound trivially; a short sleep keeps it quick.)
    """
    tr = ebrl.Trainer(lambda i: MockEnv(latency=Latency.constant(FAST_S)), VersionedPolicy(act_dim=4),
                      VersionBumpAlgo(sleep_s=0.100 if lag else 0.010),
                      ebrl.RunConfig(num_envs=4, segment_len=8, total_env_steps=480, max_policy_lag=lag,
                                     learner=learner, sim=sim_config(backend)))
    res = ebrl.run_sync(tr)
    assert res.sim_backend == backend and res.learner_mode == learner
    assert res.env_steps == res.trained == 480 and res.accounting_ok()
    h = res.history
    assert len(h) == res.updates
    assert sum(row["vb_steps"] for row in h) == res.trained  # every trained step was checked
    assert [row["vb_held_version"] for row in h] == [row["vb_learner_tag"] for row in h] == list(range(res.updates))
    assert sum(row["vb_tag_mismatch"] for row in h) == 0
    assert min(row["vb_lag_min"] for row in h) >= 0
    assert max(row["vb_lag_max"] for row in h) == lag  # within the bound, and the bound is reached
    assert res.lag_max == lag
    assert tr.policy.weights_version == res.updates  # the trained weights came back (learner process too)


def test_auto_backend_probe_runs_off_the_event_loop():
    """The AUTO probe builds and steps ``env_fn(0)`` in a forked child process (waited on by a
    thread of its own), so ``run()`` does not block the caller's loop while it measures, not even
    in C code holding the GIL. The probe's env waits until a coroutine on the loop has run: had
    the probe blocked the loop, that could never happen and it raises."""
    import multiprocessing as mp
    import os
    import threading

    from ebrl.testing import MockEnv, MockPolicy, NoopAlgo

    ctx = mp.get_context("fork")
    loop_ran, first_pid = ctx.Event(), ctx.Value("i", 0)  # shared with the forked probe

    def env_fn(i):
        with first_pid.get_lock():
            first = first_pid.value == 0
            if first:
                first_pid.value = os.getpid()
        if first and not loop_ran.wait(10):
            raise RuntimeError("the event loop stayed blocked while the probe ran")
        return MockEnv(dim=3)

    trainer = ebrl.Trainer(env_fn, MockPolicy(act_dim=3), NoopAlgo(),
                           ebrl.RunConfig(num_envs=2, segment_len=16, total_env_steps=64,
                                          sim={"start_method": "fork"}))  # a child, also where fork is not clean

    async def main():
        async def tick():
            await asyncio.sleep(0)
            loop_ran.set()

        ticker = asyncio.create_task(tick())
        result = await ebrl.run(trainer)
        await ticker
        return result

    result = asyncio.run(main())
    assert result.env_steps == 64 and result.accounting_ok()
    assert first_pid.value not in (0, os.getpid())  # the probe's env was built in another process
    assert not any(t.name.startswith("ebrl-sim-probe") for t in threading.enumerate())
    assert not mp.active_children()
