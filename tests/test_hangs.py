"""The hang matrix: an env that hangs in its constructor, its reset, its step or its render, and a
worker that dies while building, on the backends where each applies. Every case ends within its
deadline with one error or a recovery, every step accounted for, and no child process left.

These tests share "hang once" state with the children they start (``HUNG``, a multiprocessing
Event), so they ask for ``sim.start_method="fork"``: under the default, a pytest worker that has
rendered before (another test file) would start its children from a fork server, which does not
share it.
"""

import asyncio
import multiprocessing
import os
import signal
import threading
import time

import numpy as np
import pytest
from conftest import ebrl_threads

import ebrl
from ebrl.runtime.errors import EnvStepError, LearnerError
from ebrl.testing import Latency, MockEnv, MockPolicy, NoopAlgo

RELEASE = threading.Event()  # set at each test's end: a hang in this process returns
HUNG = multiprocessing.Event()  # the hang happened (in any process): later copies of the env do not hang
BUILDS = multiprocessing.Value("i", 0)  # constructions of the bad env, in any process
LIMIT = 1.0  # faults.step_timeout_s and build_timeout_s of these runs


class Hangs(MockEnv):
    """Env ``bad`` hangs once, in ``where``: ``init`` (its constructor), ``reset``, ``step`` (its
    5th) or ``render``; ``die`` kills its own process in its constructor (in a worker: not in
    the probe's child, nor in the test's process)."""

    def __init__(self, env_id, where, bad=2):
        super().__init__(dim=3, episode_len=20, latency=Latency.constant(0.0005))
        self.env_id, self.where, self.bad, self.n = env_id, where, bad, 0
        self.render_mode = "rgb_array"
        if env_id == bad:
            with BUILDS.get_lock():
                BUILDS.value += 1
            if where == "init":
                _hang()
            if where == "die" and multiprocessing.current_process().name.startswith("ebrl-sim-worker") \
                    and not HUNG.is_set():
                HUNG.set()
                os.kill(os.getpid(), signal.SIGKILL)

    def reset(self, **kw):
        if self.env_id == self.bad and self.where == "reset":
            _hang()
        return super().reset(**kw)

    def step(self, action):
        self.n += 1
        if self.env_id == self.bad and self.where == "step" and self.n == 5:
            _hang()
        return super().step(action)

    def render(self):
        if self.env_id == self.bad and self.where == "render":
            _hang()
        return np.zeros((8, 8, 3), np.uint8)


def _hang():
    if not HUNG.is_set():
        HUNG.set()
        RELEASE.wait(3600)


def _config(backend, steps=1500, **run):
    faults = {"step_timeout_s": LIMIT, "build_timeout_s": LIMIT, **run.pop("faults", {})}
    sim = {"backend": backend, "num_threads": 3, "num_workers": 2, "start_method": "fork"}
    return ebrl.RunConfig(num_envs=6, segment_len=16, total_env_steps=steps, sim=sim, faults=faults,
                          learner=run.pop("learner", "thread"), **run)


@pytest.fixture(autouse=True)
def release():
    RELEASE.clear()
    HUNG.clear()
    BUILDS.value = 0
    yield
    RELEASE.set()
    deadline = time.monotonic() + 5
    while ebrl_threads() and time.monotonic() < deadline:
        time.sleep(0.01)  # the threads left in a hang return and exit
    assert multiprocessing.active_children() == []
    assert ebrl_threads() == []


@pytest.mark.parametrize("where, op, setting", [("init", "env_fn", "build_timeout_s"),
                                                ("reset", "reset", "build_timeout_s"),
                                                ("step", "step", "step_timeout_s")])
def test_a_hang_in_the_probe_ends_the_run_with_one_error_naming_env_phase_and_setting(where, op, setting):
    trainer = ebrl.Trainer(lambda i: Hangs(i, where, bad=0), MockPolicy(act_dim=3), NoopAlgo(), _config("auto"))
    t0 = time.monotonic()
    with pytest.raises(EnvStepError) as err:
        ebrl.run_sync(trainer)
    assert err.value.env_id == 0 and err.value.op == op and err.value.reason == "timeout"
    assert f"faults.{setting}={LIMIT:g} s" in str(err.value) and "probe" in str(err.value)
    # given up at its deadline, not before (the hang itself lasts until this test ends: a probe
    # that waited for it would never return)
    assert HUNG.is_set() and time.monotonic() - t0 >= LIMIT


@pytest.mark.parametrize("backend", ["thread", "process", "mixed"])
@pytest.mark.parametrize("where", ["init", "reset"])
def test_an_env_hung_in_its_first_build_or_reset_is_rebuilt_and_the_run_goes_on(backend, where):
    trainer = ebrl.Trainer(lambda i: Hangs(i, where), MockPolicy(act_dim=3), NoopAlgo(), _config(backend))
    t0 = time.monotonic()
    res = ebrl.run_sync(trainer)
    assert HUNG.is_set() and res.accounting_ok() and res.env_steps == 1500
    # env 2's hung call timed out; a loaded machine may run another call past the 1 s limit
    # too, and that one is recovered the same way: each is charged to its own env, never to its
    # worker-mates (no failure here but timeouts)
    assert res.timeouts >= 1 and res.env_failures == res.timeouts
    assert 2 <= BUILDS.value <= 1 + res.timeouts  # built again after the hung call (at most once per timeout)
    if backend == "process":
        assert res.respawns == res.timeouts  # each hung call's worker killed and replaced
    else:  # env 2 is on a lane: its hang costs no process
        assert res.respawns <= res.timeouts - 1 if backend == "mixed" else res.respawns == 0
    assert time.monotonic() - t0 >= LIMIT  # the hung call was given its deadline


@pytest.mark.parametrize("backend", ["thread", "process", "mixed"])
def test_a_hung_step_on_every_backend_is_abandoned_and_its_env_rebuilt(backend):
    trainer = ebrl.Trainer(lambda i: Hangs(i, "step"), MockPolicy(act_dim=3), NoopAlgo(), _config(backend))
    res = ebrl.run_sync(trainer)
    assert HUNG.is_set() and res.accounting_ok() and res.env_steps == 1500
    # env 2's hung step timed out (a loaded machine may time out another step too: recovered alike)
    assert res.timeouts >= 1 and res.env_failures == res.timeouts
    assert 2 <= BUILDS.value <= 1 + res.timeouts  # env 2 rebuilt after its hung step


def test_a_render_that_hangs_during_evaluation_leaves_training_to_finish(tmp_path):
    bad = 6  # the evaluation env is env num_envs
    trainer = ebrl.Trainer(lambda i: Hangs(i, "render", bad=bad), MockPolicy(act_dim=3), NoopAlgo(),
                           _config("thread", steps=6000, eval_every_s=0.05, eval_episodes=1, log_dir=str(tmp_path)))
    res = ebrl.run_sync(trainer)
    # the render stays hung until this test ends: training finished beside it, and no evaluation did
    assert HUNG.is_set() and res.accounting_ok() and res.env_steps == 6000 and res.evaluations == []


def test_a_worker_that_dies_while_building_at_start_ends_the_run_naming_the_env():
    trainer = ebrl.Trainer(lambda i: Hangs(i, "die"), MockPolicy(act_dim=3), NoopAlgo(), _config("process"))
    with pytest.raises(EnvStepError, match=r"env 2 failed in env_fn: in worker 0: worker 0 died \(killed by SIGKILL\) "
                                           r"while building it"):
        ebrl.run_sync(trainer)


class DiesAtRebuild(Hangs):
    """Env 2 raises at its 10th step; its first rebuild kills its worker; the next one works."""

    def __init__(self, env_id):
        where = "die" if env_id == 2 and BUILDS.value >= 1 else "none"
        super().__init__(env_id, where)

    def step(self, action):
        if self.env_id == 2 and BUILDS.value == 1 and self.n == 9:
            self.n += 1
            raise RuntimeError("env 2 breaks at its 10th step")
        return super().step(action)


def test_a_worker_that_dies_while_rebuilding_an_env_is_charged_to_it_and_recovered():
    res = ebrl.run_sync(ebrl.Trainer(DiesAtRebuild, MockPolicy(act_dim=3), NoopAlgo(), _config("process")))
    assert HUNG.is_set() and res.accounting_ok() and res.env_steps == 1500
    assert res.env_failures == 2 and res.respawns == 1 and BUILDS.value == 3  # the raise, then the death


@pytest.mark.parametrize("backend, bad", [("auto", 0), ("thread", 2), ("process", 2)])
async def test_cancelling_a_run_hung_in_a_build_with_no_deadline_returns_at_once_and_frees_the_loop(backend, bad):
    """No deadline at all (build_timeout_s=None): a cancel still returns while the build is
    hung, and the caller's event loop never stops (a thread stuck in a constructor is not joined
    on it). The build stays hung until this test ends (``RELEASE``, at teardown; a worker or the
    probe's child is killed): a cancel or a loop that waited for it would never come back. The
    waits below are bounded only to fail here, with a message, instead of at pytest's timeout."""
    cfg = _config(backend, faults={"build_timeout_s": None})
    task = asyncio.ensure_future(ebrl.run(ebrl.Trainer(lambda i: Hangs(i, "init", bad), MockPolicy(act_dim=3),
                                                       NoopAlgo(), cfg)))
    ticks = 0
    while not HUNG.is_set() and ticks < 2000:
        await asyncio.sleep(0.005)
        ticks += 1
    assert HUNG.is_set()
    await asyncio.sleep(0.3)
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=BOUND_S)
    assert done, f"the cancel did not return in {BOUND_S:g} s: it waited for the hung build"
    with pytest.raises(asyncio.CancelledError):
        await task

    async def turns():  # the loop still turns
        for _ in range(20):
            await asyncio.sleep(0.001)

    await asyncio.wait_for(turns(), BOUND_S)


class HeldUpdate(NoopAlgo):
    """An update that lasts until the test ends (``RELEASE``; ``BOUND_S`` in a learner process,
    which has its own copy of it, unless killed first), and says when it returns."""

    def update(self, policy, batch):
        RELEASE.wait(BOUND_S)
        UPDATE_RETURNED.set()
        return super().update(policy, batch)


UPDATE_RETURNED = multiprocessing.Event()
BOUND_S = 30.0  # a wait for what must happen at once: the margin no load eats, only to fail with a message


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_an_update_past_update_timeout_s_ends_the_run_with_one_learner_error(mode):
    UPDATE_RETURNED.clear()
    cfg = _config("thread", faults={"update_timeout_s": 0.5}, learner=mode)
    trainer = ebrl.Trainer(lambda i: MockEnv(dim=3), MockPolicy(act_dim=3), HeldUpdate(), cfg)
    t0 = time.monotonic()
    with pytest.raises(LearnerError, match=r"faults.update_timeout_s=0.5 s"):
        ebrl.run_sync(trainer)
    # the run ended while its update was still held: it did not wait for the update (the
    # learner's thread, left with it, returns at teardown; a learner process is killed)
    assert not UPDATE_RETURNED.is_set()
    assert time.monotonic() - t0 >= 0.5  # given its deadline, not less
