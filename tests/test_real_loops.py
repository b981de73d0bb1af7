"""The runtime on real event loops (uvloop), real threads and real worker processes."""

import asyncio
import dataclasses
import multiprocessing
import time

import gymnasium as gym
import numpy as np
import pytest

import ebrl
from ebrl.policies.base import ActResult
from ebrl.testing import Latency, LatencyMode, MockEnv, MockPolicy, NoopAlgo
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
    stop, loop = asyncio.Event(), asyncio.get_running_loop()

    class StopsTheRun(MockEnv):
        """Sets the stop at its 20th step: a run stopped after a fixed time may not have stepped
        yet on a busy machine."""

        def step(self, action):
            if self.steps == 19:
                loop.call_soon_threadsafe(stop.set)
            return super().step(action)

    def env_fn(i):
        return (StopsTheRun if i == 0 else MockEnv)(latency=Latency.constant(0.0005))

    res = await ebrl.run(dataclasses.replace(make_trainer("thread", total=10**9), env_fn=env_fn), stop=stop)
    assert 20 <= res.env_steps < 10**9
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


CLOCK = [0.0, 0.0]  # the probe's clocks in this test (wall, CPU seconds), driven by ClockedStep's steps


class ClockedStep(MockEnv):
    """A step that costs ``cost`` seconds on ``CLOCK``, the clocks the probe times it on in
    ``test_auto_backend_measures_the_env``: all of them on the CPU when it spins, none when it
    sleeps. Nothing is really spun or slept, so the probe measures exactly the declared step,
    however busy the machine is (on the machine's clocks a spinning step's CPU share is the
    share of a core the machine left it: under load it reads as a step that waits)."""

    def __init__(self, cost: float, mode: str, releases_gil: bool | None = None):
        super().__init__(latency_mode=mode)
        self.cost = cost
        if releases_gil is not None:
            self.metadata = {**self.metadata, "ebrl.releases_gil": releases_gil}

    def step(self, action):
        CLOCK[0] += self.cost
        if self.latency_mode is LatencyMode.SPIN:
            CLOCK[1] += self.cost
        return super().step(action)


async def test_auto_backend_measures_the_env(monkeypatch):
    """AUTO times env 0's step in the probe and the start rule picks the backend from what it
    measured (the rule's thresholds: the test above). The probe reads ``CLOCK`` here
    (``probe.STEP_CLOCKS``), so each run's measured step is the one its env declares."""
    from ebrl.runtime import probe

    monkeypatch.setattr(probe, "STEP_CLOCKS", (lambda: CLOCK[0], lambda: CLOCK[1]))

    async def run(cost, mode, **kw):
        res = await ebrl.run(ebrl.Trainer(lambda i: ClockedStep(cost, mode, **kw), MockPolicy(act_dim=4), NoopAlgo(),
                                          ebrl.RunConfig(num_envs=8, segment_len=16, total_env_steps=200)))
        assert res.env_steps == 200 and res.accounting_ok()
        return res.sim_backend, res.decisions[0]

    # 5 us: under sim.inline_below_s (20 us), less than a thread hop
    backend, first = await run(5e-6, "spin")
    assert backend == "inline" and "a step took 5 us" in first["reason"]
    # 2 ms of CPU holding the GIL: worker processes
    backend, first = await run(2e-3, "spin")
    assert backend == "process"
    # the start decision that chose it is the run's first, with what was measured in its reason
    assert (first["epoch"], first["knob"], first["old"], first["new"]) == (-1, "backend", "auto", "process")
    assert "a step took 2000 us, 100% of it on a CPU" in first["reason"] and "GIL" in first["reason"]
    # 2 ms asleep, and the env does not say it releases the GIL: the measured CPU share decides
    backend, first = await run(2e-3, "sleep", releases_gil=False)
    assert backend == "thread" and "a step took 2000 us, 0% of it on a CPU" in first["reason"]
    assert "mostly waits" in first["reason"]


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
    import uvloop

    tr = ebrl.Trainer(lambda i: gym.make("CartPole-v1"), MockPolicy(act_dim=None, n_actions=2, random=True), NoopAlgo(),
                      ebrl.RunConfig(num_envs=4, segment_len=32, total_env_steps=1000))
    loops = []  # the loop the run ran on, seen from its progress reports (called on the loop)
    res = ebrl.run_sync(tr, progress=lambda stats, learner: loops.append(asyncio.get_running_loop()))
    assert loops and all(type(loop) is uvloop.Loop for loop in loops), {type(loop) for loop in loops}
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
    shape = (100, 1000, 3)

    def picture(env_id, step):
        """300 kB that only env ``env_id``'s step ``step`` shows: byte ``k`` is ``(k * (2 env_id + 3) + step) mod 251``,
        so byte 0 names the step, byte 1 the env, and a byte lost, shifted or mixed up shows."""
        k = np.arange(np.prod(shape), dtype=np.int64)
        return ((k * (2 * env_id + 3) + step) % 251).astype(np.uint8).reshape(shape)

    class BigObs(MockEnv):
        """Dict observations of 300 kB: several socket buffers per message."""

        def __init__(self, env_id):
            super().__init__(dim=2, episode_len=5)
            self.env_id = env_id
            self.observation_space = gym.spaces.Dict({"big": gym.spaces.Box(0, 255, shape, np.uint8),
                                                      "state": self.observation_space})

        def _observe(self):
            return {"big": picture(self.env_id, self.steps % 251), "state": super()._observe()}

    checked = []  # (env id, step, intact) of every observation the policy acted on

    class Checking(MockPolicy):
        """Compares each observation it is given, byte for byte, with the one its env sent."""

        def act(self, obs):
            for big in np.asarray(obs["big"]):
                step, env_id = int(big.flat[0]), (int(big.flat[1]) - int(big.flat[0]) - 3) % 251 // 2
                checked.append((env_id, step, np.array_equal(big, picture(env_id, step))))
            return super().act(obs)

    tr = ebrl.Trainer(BigObs, Checking(act_dim=2), NoopAlgo(),
                      ebrl.RunConfig(num_envs=4, segment_len=8, total_env_steps=64, sim={"backend": "process"}))
    res = await ebrl.run(tr)
    assert res.env_steps == 64 and res.episodes > 0 and res.accounting_ok()
    assert len(checked) >= 64 and {env_id for env_id, _, _ in checked} == {0, 1, 2, 3}
    assert [c for c in checked if not c[2]] == []  # every observation arrived as its env sent it
    for env_id in range(4):  # and each env's in order: its steps 0, 1, 2, ...
        steps = [step for e, step, _ in checked if e == env_id]
        assert steps == list(range(len(steps))), (env_id, steps)


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
    # fork: the children share this module's counters (a process that rendered before would use a fork server)
    return ({"backend": "thread", "num_threads": 4, "start_method": "fork"} if backend == "thread"
            else {"backend": "process", "num_workers": 2, "start_method": "fork"})


STEPS = multiprocessing.Array("i", 4)  # each env's steps, counted where it steps (its worker shares this)
GATE, GATED = 12, 16  # env 0's first GATED steps (a segment) each last until every fast env has taken GATE more
PASSED = multiprocessing.Value("i", 0)  # env 0's steps that waited so
HELD = multiprocessing.Value("i", 0)  # 1: a step of env 0 waited GATE_WAIT_S without the fast envs getting there
GATE_WAIT_S = 30.0  # (a loaded machine takes milliseconds; a barrier, for ever)


class SlowBySteps(MockEnv):
    """Env 0 is slow by steps, not by seconds: each of its first ``GATED`` steps lasts until every
    env in ``fast`` has taken ``GATE`` steps more. The others step in ``FAST_S``."""

    def __init__(self, env_id: int, fast: list[int]):
        super().__init__(latency=Latency.constant(FAST_S))
        self.env_id, self.fast = env_id, fast

    def step(self, action):
        if self.env_id == 0 and PASSED.value < GATED and not HELD.value:
            start, deadline = [STEPS[i] for i in self.fast], time.monotonic() + GATE_WAIT_S
            while any(STEPS[i] - n < GATE for i, n in zip(self.fast, start)):
                if time.monotonic() > deadline:
                    HELD.value = 1  # no more waits: the run ends, and the test fails on HELD
                    break
                time.sleep(0.0005)
            else:
                PASSED.value += 1
        out = super().step(action)
        STEPS[self.env_id] += 1  # one writer per entry: the env's own lane or worker
        return out


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_no_barrier_on_real_loops_fast_envs_run_ahead_of_a_slow_one(backend, no_leaks):
    """Async, real threads and processes: while env 0 is in a step, nothing makes the others wait.

    Env 0's first 16 steps (its first segment) each wait for every fast env to take 12 steps
    (``SlowBySteps``): counted, not timed, so the fast envs run ahead by at least that much on any
    machine, however busy. A barrier holds them instead, and a wait of env 0 runs out: the
    generator waiting for every env at once, or the learner waiting for env 0's segment (the
    fast envs then fill the queue, 4 updates' worth of segments, and park before env 0's segment
    is done: they need 192 steps each, more than the queue and their open segments hold). The
    lag bound allows 3 updates, so an update that rightly waits for env 0's step in flight
    (lag 1 would) has had room made for more steps than the fast envs need meanwhile. The
    budget is far more than the gated steps use, so the run never ends inside a wait. On the
    process backend env ``i`` lives in worker ``i % 2`` and a worker steps its envs one after
    another, so env 2 shares env 0's worker and its pace; envs 1 and 3 (the other worker) are
    the ones that must run ahead.
    """
    fast = [1, 2, 3] if backend == "thread" else [1, 3]
    STEPS[:] = [0] * 4
    PASSED.value = HELD.value = 0
    tr = ebrl.Trainer(lambda i: SlowBySteps(i, fast), MockPolicy(act_dim=4), NoopAlgo(),
                      ebrl.RunConfig(num_envs=4, segment_len=16, total_env_steps=3000, max_policy_lag=3,
                                     sim=sim_config(backend)))
    res = ebrl.run_sync(tr)
    assert res.sim_backend == backend and res.env_steps == 3000 and res.accounting_ok()
    assert not HELD.value, f"a step of env 0 waited {GATE_WAIT_S:g} s for the fast envs: they were held back"
    assert PASSED.value == GATED  # every gated step of env 0 saw each fast env take GATE steps meanwhile
    counts = res.steps_per_env
    assert counts == list(STEPS[:]) and min(counts[i] for i in fast) >= GATE * GATED, counts


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


FULL = multiprocessing.Value("i", 0)  # 1: every env still stepping is parked on a full rollout queue, or none is left
FILL_WAIT_S = 60.0  # (the queue fills in milliseconds; never: an error)


def mirror_full_queue(monkeypatch) -> None:
    """Keep ``FULL`` up to date, for a learner in a thread or a (forked) process: the run state
    says when every live env parks or finishes (``RunState.changed``), and the driver when it
    lets parked envs go on (``Driver.unpark``, after the learner took segments)."""
    from ebrl.runtime.driver.loop import Driver
    from ebrl.runtime.state import RunState

    changed, unpark = RunState.changed, Driver.unpark

    def changed_and_mirrored(self):
        FULL.value = int(self.all_parked or self.active <= 0)
        changed(self)

    def unpark_and_mirrored(self):
        FULL.value = int(self.state.active <= 0)
        unpark(self)

    FULL.value = 0
    monkeypatch.setattr(RunState, "changed", changed_and_mirrored)
    monkeypatch.setattr(Driver, "unpark", unpark_and_mirrored)


class VersionedPolicy(MockPolicy):
    """A :class:`MockPolicy` whose every action component is the version of the weights that chose it.

    The version lives in the weights (``state_dict()["weights_version"]``), so it travels
    the same way real weights do: an algorithm bumps it in ``update`` (``NoopAlgo`` does),
    the learner publishes the state dict, the generator loads it into its copy. A recorded
    transition's action therefore says which weights really acted, independently of the
    version tag the generator attaches (``Batch.versions``); :meth:`acted_versions` reads them
    back from a training batch."""

    def __init__(self, act_dim: int = 4, **kwargs):
        super().__init__(act_dim, **kwargs)

    def act(self, obs) -> ActResult:
        res = super().act(obs)
        a = np.full_like(res.actions, self.weights_version)
        return ActResult(actions=a, env_actions=a, logprobs=res.logprobs, values=res.values)

    @staticmethod
    def acted_versions(batch):
        """The acting weights' version of every valid step of ``batch`` (a 1-D int64 tensor, in ``mask`` order)."""
        acts = batch.actions[batch.mask]  # [N, act_dim]
        return acts[:, 0].round().long()


class VersionBumpAlgo:
    """Checks every trained step against the weights that really acted (``VersionedPolicy``), then
    bumps the weights' version. Runs wherever the learner runs (a thread, or a child process),
    so it reports through the metrics dict that ``update`` returns (``RunResult.history``), under
    keys of its own: the runtime's row keys (its tag-based ``lag_max`` among them) win a clash.
    ``until_full``: an update lasts until the rollout queue is full (``FULL``): training slower
    than rollout, whatever either costs, so the lag bound is under pressure."""

    def __init__(self, until_full: bool):
        self.until_full = until_full

    def update(self, policy, batch):
        held = policy.weights_version  # the learner's weights, before this update
        acted = VersionedPolicy.acted_versions(batch)  # the weights that produced each action
        tags = batch.versions[batch.mask]  # the generator's version tags
        lags = held - acted
        deadline = time.monotonic() + FILL_WAIT_S
        while self.until_full and not FULL.value:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the envs did not fill the rollout queue in {FILL_WAIT_S:g} s")
            time.sleep(0.0005)
        policy.weights_version += 1
        return {"vb_held_version": held, "vb_learner_tag": batch.learner_version, "vb_steps": len(acted),
                "vb_lag_max": int(lags.max()), "vb_lag_min": int(lags.min()),
                "vb_tag_mismatch": int((acted != tags).sum())}


@pytest.mark.parametrize(("backend", "learner", "lag"), [
    *[("thread", learner, lag) for learner in ("thread", "process") for lag in (0, 1, 2)],
    ("process", "thread", 1),
    ("process", "process", 2),
])
def test_lag_bound_holds_against_the_weights_that_acted(backend, learner, lag, no_leaks, monkeypatch):
    """max_policy_lag, measured from the actions themselves, not from the generator's tags.

    ``VersionedPolicy`` writes the version of the weights it holds into every action; the
    learner-side ``VersionBumpAlgo`` compares it with the version of the weights it trains.
    Fails if a trained step is older than ``max_policy_lag`` updates (a missed cut, a stale
    in-flight step not awaited, weights not reaching the generator), if a tag disagrees with
    the weights that acted (a tag taken before or after the weights swap), or if the learner's
    version counter drifts from its weights. With lag > 0 an update lasts until every env is
    parked on the full queue (or the budget is spent): each update then finds the queue full, so
    the oldest steps it holds wait the most updates the bound allows, and the lag must reach the
    bound on any machine (a test that never comes near it proves nothing; an update that slept
    a fixed time would leave that to how fast the machine steps meanwhile). Lag 0 pauses
    generation during updates (there is nothing to wait for) and reaches its bound trivially.
    """
    mirror_full_queue(monkeypatch)
    tr = ebrl.Trainer(lambda i: MockEnv(latency=Latency.constant(FAST_S)), VersionedPolicy(act_dim=4),
                      VersionBumpAlgo(until_full=lag > 0),
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
