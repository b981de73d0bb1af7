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
    assert HUNG.is_set() and time.monotonic() - t0 < LIMIT + 10


@pytest.mark.parametrize("backend", ["thread", "process", "mixed"])
@pytest.mark.parametrize("where", ["init", "reset"])
def test_an_env_hung_in_its_first_build_or_reset_is_rebuilt_and_the_run_goes_on(backend, where):
    trainer = ebrl.Trainer(lambda i: Hangs(i, where), MockPolicy(act_dim=3), NoopAlgo(), _config(backend))
    t0 = time.monotonic()
    res = ebrl.run_sync(trainer)
    assert HUNG.is_set() and res.accounting_ok() and res.env_steps == 1500
    assert res.timeouts == 1 and res.env_failures == 1  # charged to env 2, not to its worker-mates
    assert BUILDS.value == 2  # built again after the hung call
    assert res.respawns == (1 if backend == "process" else 0)
    assert time.monotonic() - t0 < LIMIT + 20


@pytest.mark.parametrize("backend", ["thread", "process", "mixed"])
def test_a_hung_step_on_every_backend_is_abandoned_and_its_env_rebuilt(backend):
    trainer = ebrl.Trainer(lambda i: Hangs(i, "step"), MockPolicy(act_dim=3), NoopAlgo(), _config(backend))
    res = ebrl.run_sync(trainer)
    assert HUNG.is_set() and res.accounting_ok() and res.env_steps == 1500
    assert res.timeouts == 1 and BUILDS.value == 2


def test_a_render_that_hangs_during_evaluation_leaves_training_to_finish(tmp_path):
    bad = 6  # the evaluation env is env num_envs
    trainer = ebrl.Trainer(lambda i: Hangs(i, "render", bad=bad), MockPolicy(act_dim=3), NoopAlgo(),
                           _config("thread", steps=6000, eval_every_s=0.05, eval_episodes=1, log_dir=str(tmp_path)))
    t0 = time.monotonic()
    res = ebrl.run_sync(trainer)
    assert HUNG.is_set() and res.accounting_ok() and res.env_steps == 6000 and res.evaluations == []
    assert time.monotonic() - t0 < 30


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
    """No deadline at all (build_timeout_s=None): a cancel still returns within a second, and the
    caller's event loop never stops (a thread stuck in a constructor is not joined on it)."""
    cfg = _config(backend, faults={"build_timeout_s": None})
    task = asyncio.ensure_future(ebrl.run(ebrl.Trainer(lambda i: Hangs(i, "init", bad), MockPolicy(act_dim=3),
                                                       NoopAlgo(), cfg)))
    ticks, gaps, last = 0, [], time.monotonic()
    while not HUNG.is_set() and ticks < 2000:
        await asyncio.sleep(0.005)
        ticks += 1
    assert HUNG.is_set()
    await asyncio.sleep(0.3)
    t0 = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.monotonic() - t0 < 2.0
    for _ in range(20):  # the loop still turns
        await asyncio.sleep(0.001)
        gaps.append(time.monotonic() - last)
        last = time.monotonic()
    assert max(gaps[1:]) < 0.5


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_an_update_past_update_timeout_s_ends_the_run_with_one_learner_error(mode):
    cfg = _config("thread", faults={"update_timeout_s": 0.5}, learner=mode)
    trainer = ebrl.Trainer(lambda i: MockEnv(dim=3), MockPolicy(act_dim=3), NoopAlgo(sleep_s=4.0), cfg)
    t0 = time.monotonic()
    with pytest.raises(LearnerError, match=r"faults.update_timeout_s=0.5 s"):
        ebrl.run_sync(trainer)
    assert time.monotonic() - t0 < 4.0  # the learner's thread, left with its update, ends before teardown's check
