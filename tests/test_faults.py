"""Faults survived, on real event loops: hung steps time out, dead workers are respawned, a
dead learner stops the run with one clear error, and a stop or cancel ends run() promptly."""

import asyncio
import multiprocessing
import os
import signal
import threading
import time

import pytest
from conftest import ebrl_threads

import ebrl
from ebrl.runtime.errors import LearnerError
from ebrl.testing import Latency, MockEnv, MockPolicy, NoopAlgo

RELEASE = threading.Event()  # set at a test's end: a step hung on it returns


HUNG = multiprocessing.Event()  # set once env 3 has hung (in any process): its rebuilt copy does not


class HangsOnce(MockEnv):
    """Env ``bad`` hangs (until RELEASE, or an hour) at its step ``at``, once in the run."""

    def __init__(self, env_id, bad=3, at=50):
        super().__init__(dim=3, episode_len=20, latency=Latency.constant(0.0005))
        self.env_id, self.bad, self.at, self.n = env_id, bad, at, 0

    def step(self, action):
        self.n += 1
        if self.env_id == self.bad and self.n == self.at and not HUNG.is_set():
            HUNG.set()
            RELEASE.wait(3600)
        return super().step(action)


def _trainer(backend, steps=2000, timeout=0.5, **run):
    # start_method fork: HUNG is shared with the workers through the fork (a pytest process that
    # rendered in an earlier test would otherwise start them from a fork server)
    cfg = ebrl.RunConfig(**{"num_envs": 8, "segment_len": 16, "total_env_steps": steps,
                            "sim": {"backend": backend, "num_threads": 4, "num_workers": 2, "start_method": "fork"},
                            "faults": {"step_timeout_s": timeout}, **run})
    return ebrl.Trainer(HangsOnce, MockPolicy(act_dim=3), NoopAlgo(), cfg)


@pytest.fixture
def release():
    RELEASE.clear()
    HUNG.clear()
    yield
    RELEASE.set()
    deadline = time.monotonic() + 5
    while any(n.startswith("ebrl-sim") for n in ebrl_threads()) and time.monotonic() < deadline:
        time.sleep(0.01)  # the abandoned lane returns and exits


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_a_hung_step_is_abandoned_its_env_replaced_and_the_run_goes_on(backend, release):
    res = ebrl.run_sync(_trainer(backend))
    assert HUNG.is_set() and res.accounting_ok() and res.env_steps == 2000
    # env 3's hung step timed out, and env 3 was rebuilt (its open segment dropped as timeout). A
    # loaded machine may run another step past the 0.5 s limit too: recovered the same way, and
    # charged to its own env (no failure here but timeouts; a killed worker's mates are not charged)
    assert res.timeouts >= 1 and res.env_failures == res.timeouts
    assert set(res.dropped) <= {"timeout", "worker_died"}  # a killed worker's other steps in flight
    assert res.respawns == (res.timeouts if backend == "process" else 0)  # one worker killed per hung step
    assert multiprocessing.active_children() == []


BUILT = multiprocessing.Value("i", 0)  # env 3's constructions, in any process


class HangsInReset(MockEnv):
    """Env 3 hangs (until RELEASE, or an hour) once, in a reset or build the driver asked for:
    ``first`` its first reset; ``build`` its rebuild after a raising step (env_fn hangs);
    ``rebuilt`` the reset of that rebuilt env."""

    def __init__(self, env_id, where):
        super().__init__(dim=3, episode_len=20, latency=Latency.constant(0.0005))
        self.env_id, self.where, self.n = env_id, where, 0
        if env_id == 3:
            with BUILT.get_lock():
                BUILT.value += 1
                self.build = BUILT.value
            if where == "build" and self.build == 2:
                _hang()

    def reset(self, **kw):
        if self.env_id == 3 and (self.where, self.build) in (("first", 1), ("rebuilt", 2)):
            _hang()
        return super().reset(**kw)

    def step(self, action):
        self.n += 1
        if self.env_id == 3 and self.build == 1 and self.n == 10 and self.where != "first":
            raise RuntimeError("env 3 breaks at its 10th step")
        return super().step(action)


def _hang():
    if not HUNG.is_set():
        HUNG.set()
        RELEASE.wait(3600)


@pytest.mark.parametrize("backend", ["thread", "process"])
@pytest.mark.parametrize("where", ["first", "build", "rebuilt"])
def test_a_hung_reset_or_rebuild_is_abandoned_its_env_replaced_and_the_run_goes_on(backend, where, release):
    BUILT.value = 0
    cfg = ebrl.RunConfig(num_envs=8, segment_len=16, total_env_steps=2000, faults={"build_timeout_s": 0.5},
                         sim={"backend": backend, "num_threads": 4, "num_workers": 2, "start_method": "fork"})
    trainer = ebrl.Trainer(lambda i: HangsInReset(i, where), MockPolicy(act_dim=3), NoopAlgo(), cfg)
    t0 = time.monotonic()
    res = ebrl.run_sync(trainer)
    assert HUNG.is_set() and res.accounting_ok() and res.env_steps == 2000
    # the hung call timed out and env 3 was built again after it. A loaded machine may run
    # another build or reset past the 0.5 s limit too: rebuilt the same way, at most once each
    built = 2 if where == "first" else 3  # (the raising step's rebuild, for "build" and "rebuilt")
    assert res.timeouts >= 1 and built <= BUILT.value <= built - 1 + res.timeouts
    assert res.env_failures >= (1 if where == "first" else 2)  # the raising step, the timeout (not the worker-mates)
    assert set(res.dropped) <= {"env_error", "worker_died"}  # a reset has no open segment to drop
    assert res.respawns == (res.timeouts if backend == "process" else 0)  # one worker killed per hung call
    assert time.monotonic() - t0 >= 0.5  # the hung call was given its deadline
    assert multiprocessing.active_children() == []


async def _kill_mid_run(trainer, name: str, after_s: float):
    """``run(trainer)``, with the first child process named ``name...`` SIGKILLed after ``after_s``."""
    task = asyncio.ensure_future(ebrl.run(trainer))
    await asyncio.sleep(after_s)
    for _ in range(200):  # a fork server's first child (a pytest process that rendered before) takes seconds
        victims = [p for p in multiprocessing.active_children() if p.name.startswith(name)]
        if victims:
            break
        await asyncio.sleep(0.05)
    victim = victims[0]
    os.kill(victim.pid, signal.SIGKILL)
    return await task


def test_a_killed_worker_is_respawned_and_its_envs_rebuilt(no_leaks):
    # start_method fork: killed mid-run, not while a fork server's first child starts (a pytest process that rendered before)
    cfg = ebrl.RunConfig(num_envs=8, segment_len=16, total_env_steps=6000,
                         sim={"backend": "process", "num_workers": 2, "start_method": "fork"}, resources={"adapt": False})
    trainer = ebrl.Trainer(lambda i: MockEnv(dim=3, episode_len=20, latency=Latency.constant(0.001)),
                           MockPolicy(act_dim=3), NoopAlgo(), cfg)

    res = asyncio.run(_kill_mid_run(trainer, "ebrl-sim-worker", after_s=0.5))
    assert res.accounting_ok() and res.env_steps == 6000
    assert res.respawns == 1 and set(res.dropped) <= {"worker_died"} and res.timeouts == 0


def test_a_dead_learner_process_stops_the_run_naming_the_signal_and_checkpoints(tmp_path, no_leaks):
    from ebrl.checkpoint import load_checkpoint

    import torch

    from ebrl.algos import PPO
    from ebrl.policies import MLPPolicy

    cfg = ebrl.RunConfig(num_envs=4, segment_len=16, total_env_steps=10**7, learner="process",
                         log_dir=str(tmp_path), checkpoint_every_s=3600.0, log_every_s=0.02,
                         sim={"backend": "thread", "num_threads": 2, "start_method": "fork"})

    env = MockEnv(dim=3, episode_len=20)
    make = lambda seed: MLPPolicy.from_spaces(env.observation_space, env.action_space, seed=seed)  # noqa: E731
    trainer = ebrl.Trainer(lambda i: MockEnv(dim=3, episode_len=20), make(0), PPO(), cfg)
    initial = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    seen = []  # the run's learner, handed to progress()

    async def kill_after_an_update():
        """SIGKILL the learner process once an update has been published (not after a fixed
        time: a loaded machine may not have trained by then, and there would be nothing to check)."""
        task = asyncio.ensure_future(ebrl.run(trainer, progress=lambda stats, learner: seen.append(learner)))
        deadline = time.monotonic() + 60
        while not (seen and seen[-1].version >= 1) and not task.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        victims = [p for p in multiprocessing.active_children() if p.name.startswith("ebrl-learner")]
        assert seen and seen[-1].version >= 1 and victims, "no update was published"
        os.kill(victims[0].pid, signal.SIGKILL)
        return await task

    with pytest.raises(LearnerError, match=r"the learner process died \(killed by SIGKILL\)"):
        asyncio.run(kill_after_an_update())
    learner = seen[-1]
    fresh = ebrl.Trainer(lambda i: MockEnv(dim=3), make(1), PPO())
    meta = load_checkpoint(tmp_path / "checkpoint.pt", fresh)
    # the checkpoint holds the weights the generator acted with last: the latest update's
    assert meta["updates"] == learner.version >= 1
    loaded, published = fresh.policy.state_dict(), learner.published()
    assert published and set(published) <= set(loaded)
    for k, v in published.items():
        torch.testing.assert_close(loaded[k], v.cpu(), rtol=0, atol=0, msg=f"{k} differs from the published weights")
    assert any(not torch.equal(loaded[k], initial[k]) for k in published), "the checkpoint holds untrained weights"


BOUND_S = 30.0  # a wait for what must happen at once: the margin no load eats, only to fail with a message


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_a_stop_or_a_cancel_ends_the_run_promptly_even_with_a_step_hung_and_no_timeout(backend, release):
    """No step timeout, and env 3's step hangs until this test ends (``RELEASE``, at teardown; a
    worker is killed): a stop or a cancel that waited for the hung step would never return. Each
    is awaited ``BOUND_S`` at most, only to fail here instead of at pytest's timeout."""
    async def hung_run(stop=None):
        HUNG.clear()  # env 3 hangs again in this run
        task = asyncio.ensure_future(ebrl.run(_trainer(backend, steps=10**7, timeout=None), stop=stop))
        deadline = time.monotonic() + BOUND_S
        while not HUNG.is_set() and not task.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # env 3 hangs at its 50th step
        assert HUNG.is_set() and not task.done()
        return task

    async def stopped():
        stop = asyncio.Event()
        task = await hung_run(stop)
        stop.set()
        done, _ = await asyncio.wait([task], timeout=BOUND_S)
        assert done, "the stop waited for the hung step"
        return task.result()

    res = asyncio.run(stopped())
    assert res.accounting_ok() and res.in_flight_at_stop >= 1  # env 3's hung step among those left in flight

    async def cancelled():
        task = await hung_run()
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=BOUND_S)
        assert done, "the cancel waited for the hung step"
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled())
    assert multiprocessing.active_children() == []


def test_sim_workers_and_the_learner_exit_when_their_parent_is_killed(tmp_path):
    """A SIGKILLed run leaves no process behind: each child watches its parent (forked siblings
    hold copies of the parent's pipe ends, so a closed pipe alone would not tell them)."""
    import subprocess
    import sys

    script = tmp_path / "victim.py"
    script.write_text(
        "import ebrl, sys\n"
        "from ebrl.testing import MockEnv, Latency\n"
        "from ebrl.algos import PPO\n"
        "from ebrl.policies import MLPPolicy\n"
        "env = MockEnv(dim=3)\n"
        "cfg = ebrl.RunConfig(num_envs=4, segment_len=16, total_env_steps=10**9, learner='process',\n"
        "                     sim={'backend': 'process', 'num_workers': 2})\n"
        "policy = MLPPolicy.from_spaces(env.observation_space, env.action_space)\n"
        "ebrl.run_sync(ebrl.Trainer(lambda i: MockEnv(dim=3, latency=Latency.constant(0.001)), policy, PPO(), cfg))\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        children: list[int] = []
        while len(children) < 3 and time.monotonic() < deadline:  # two sim workers and the learner
            time.sleep(0.2)
            children = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                                        text=True).stdout.split()]
        assert len(children) >= 3
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}") for pid in children):
            time.sleep(0.1)
        alive = [pid for pid in children if os.path.exists(f"/proc/{pid}")
                 and open(f"/proc/{pid}/stat").read().split()[2] != "Z"]
        assert alive == []
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_child_whose_parent_died_before_it_looked_still_exits(tmp_path):
    """The parent is killed between a child's fork and its first look at its parent (a busy
    machine): the child must still see that it is orphaned, not take init for its parent. The
    child looks only once its parent is gone, and says when it has looked (importing ebrl takes
    seconds on a busy machine: the test waits for that, not for a fixed time)."""
    import subprocess
    import sys

    script = tmp_path / "orphan.py"
    pid_file, looked = tmp_path / "child.pid", tmp_path / "looked"
    script.write_text(
        "import multiprocessing as mp, os, sys, time\n"
        "def child():\n"
        "    parent = mp.parent_process().pid\n"
        "    while os.getppid() == parent:  # the parent is gone before the child looks\n"
        "        time.sleep(0.01)\n"
        "    from ebrl.runtime.threads import ignore_stop_signals\n"
        "    ignore_stop_signals()\n"
        f"    open({str(looked)!r}, 'w').close()\n"
        "    time.sleep(300)\n"
        "p = mp.get_context('fork').Process(target=child)\n"
        "p.start()\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "os._exit(0)\n")
    subprocess.run([sys.executable, str(script)], check=True)
    pid = int(pid_file.read_text())

    def alive() -> bool:
        try:
            return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
        except FileNotFoundError:
            return False

    try:
        deadline = time.monotonic() + 60
        while alive() and not looked.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert looked.exists() or not alive(), "the child never got to look at its parent"
        deadline = time.monotonic() + 20  # it looks every half second
        while alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive()
    finally:
        if alive():
            os.kill(pid, 9)
