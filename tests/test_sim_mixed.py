"""A pool with both hosts: envs on thread lanes and in worker processes, moved between them; and the rule that moves them."""

import multiprocessing
import os

import numpy as np
import pytest
from test_resources import idle_machine_costs, profile
from test_sim_workers import PidEnvs, started, step_all

import ebrl
from ebrl.config import SimBackend, SimConfig
from ebrl.runtime.errors import EnvStepError
from ebrl.runtime.resources.knobs import Knobs, Limits, Memory
from ebrl.runtime.resources.rules_sim import backend_rule
from ebrl.runtime.sim import LOCAL, SimPool
from ebrl.runtime.sim.block import CPU, STEPS, WALL
from ebrl.testing import Latency, LatencyMode, MockEnv, MockPolicy, NoopAlgo

HERE = os.getpid()


def MixedSimPool(env_fn, num_envs, lanes, workers, start=SimBackend.THREAD, start_method=None):  # noqa: N802
    """Envs that start on the lanes (or on the workers) and may move between them."""
    backend = "mixed" if start is SimBackend.THREAD else "process"
    return SimPool(env_fn, num_envs, SimConfig(backend=backend, num_workers=workers, start_method=start_method),
                   lanes=lanes, movable=True)


async def test_envs_move_from_the_lanes_to_workers_and_back_and_step_where_they_are(tmp_path, no_leaks):
    pool = MixedSimPool(PidEnvs(tmp_path), num_envs=4, lanes=2, workers=2)
    col = await started(pool)
    try:
        assert pool.backend is SimBackend.THREAD and pool.placement.tolist() == [LOCAL] * 4
        assert pool.workers == 0 and pool.size == 2  # no worker until an env moves to one
        assert await step_all(pool, col, range(4)) == dict.fromkeys(range(4), HERE)
        await pool.grow(2)
        _, info = await pool.migrate(1, 0, seed=None)
        await pool.migrate(3, 1, seed=None)
        workers = pool.worker_pids()
        assert info["pid"] == workers[0] != HERE
        assert pool.backend is SimBackend.MIXED and pool.placement.tolist() == [LOCAL, 0, LOCAL, 1]
        # one block over both parts comes back whole, each env from where it lives
        assert await step_all(pool, col, range(4)) == {0: HERE, 1: workers[0], 2: HERE, 3: workers[1]}
        assert (tmp_path / f"closed-1-{HERE}").exists()  # the lanes' copy was closed
        _, info = await pool.migrate(1, LOCAL, seed=None)  # and back
        assert info["pid"] == HERE and pool.placement.tolist() == [LOCAL, LOCAL, LOCAL, 1]
        assert await step_all(pool, col, range(4)) == {0: HERE, 1: HERE, 2: HERE, 3: workers[1]}
        # each part counts the steps its envs took there; together, every step once
        np.testing.assert_array_equal(pool.costs()[:, STEPS], [3, 3, 3, 3])
        assert pool.migrations == 3
        with pytest.raises(ValueError, match="already on the thread lanes"):
            await pool.migrate(0, LOCAL)
    finally:
        pool.close()
    assert multiprocessing.active_children() == []


async def test_a_pool_that_starts_in_workers_moves_envs_to_lanes_it_builds_none_on_at_start(tmp_path, no_leaks):
    # start_method fork: env 0's spaces are read in the probe's child also where this process rendered before
    pool = MixedSimPool(PidEnvs(tmp_path), num_envs=3, lanes=2, workers=2, start=SimBackend.PROCESS,
                        start_method="fork")
    col = await started(pool)
    try:
        assert pool.backend is SimBackend.PROCESS and pool.placement.tolist() == [0, 1, 0]
        assert not list(tmp_path.glob(f"*-{HERE}"))  # nothing was built (and closed) on the lanes
        workers = pool.worker_pids()
        await pool.migrate(2, LOCAL, seed=None)
        assert await step_all(pool, col, range(3)) == {0: workers[0], 1: workers[1], 2: HERE}
        assert (tmp_path / f"closed-2-{workers[0]}").exists()  # the worker's copy was closed
    finally:
        pool.close()
    assert multiprocessing.active_children() == []


async def test_a_move_whose_build_fails_leaves_the_env_where_it_was(tmp_path, no_leaks):
    pool = MixedSimPool(PidEnvs(tmp_path), num_envs=2, lanes=2, workers=1)
    col = await started(pool)
    try:
        await pool.grow(1)
        (tmp_path / "fail").touch()  # env_fn now raises, in every process
        with pytest.raises(EnvStepError, match="no simulator here"):
            await pool.migrate(0, 0, seed=None)
        (tmp_path / "fail").unlink()
        assert pool.placement.tolist() == [LOCAL, LOCAL]
        assert await step_all(pool, col, range(2)) == {0: HERE, 1: HERE}
        await pool.migrate(1, 0, seed=None)
        (tmp_path / "fail").touch()
        with pytest.raises(EnvStepError):
            await pool.migrate(1, LOCAL, seed=None)
        (tmp_path / "fail").unlink()
        assert pool.placement.tolist() == [LOCAL, 0]
        assert (await step_all(pool, col, [1]))[1] == pool.worker_pids()[0]
    finally:
        pool.close()
    assert multiprocessing.active_children() == []


# ---------------------------------------------------------------- the rule


def _mixed_window(n=16, window=1.0):
    """As measured on lanes (bench/suites/controller.py, mixed): even envs compute 160 us in
    a 240 us step (their GIL waits included), odd envs sleep: 95 us of CPU in a 2.7 ms step.
    Together the lanes' steps compute 0.74 of a core."""
    gil = np.arange(n) % 2 == 0
    return profile(n=n, window=window, steps=np.where(gil, 400, 300), wall=np.where(gil, 0.096, 0.81),
                   cpu=np.where(gil, 0.064, 0.0285)), gil


def test_computing_envs_leave_the_lanes_for_workers_spread_over_them():
    p, gil = _mixed_window()
    knobs = Knobs("thread", lanes=16, workers=0, placement=(LOCAL,) * 16, mixed=True)
    d = backend_rule(p, knobs, Limits(num_units=16, cpus=2), Memory())
    new = np.array(d.new)
    assert d.knob == "backend" and (new[~gil] == LOCAL).all()
    assert sorted(np.bincount(new[gil], minlength=2).tolist()) == [4, 4]  # one worker per core, balanced
    assert "GIL" in d.reason and "episode end" in d.reason


def test_waiting_envs_leave_workers_for_the_lanes():
    p = profile(n=4, steps=400, wall=0.9, cpu=np.array([0.9, 0.01, 0.9, 0.01]))
    knobs = Knobs("mixed", lanes=2, workers=2, placement=(0, 1, 0, 1), mixed=True)
    d = backend_rule(p, knobs, Limits(num_units=4, cpus=2), Memory())
    assert d.new == (0, LOCAL, 0, LOCAL) and "wait" in d.reason


def test_on_saturated_cores_a_starved_worker_step_is_not_taken_for_a_wait():
    # FetchReach in two workers beside the generator and learner on two busy cores: its steps get
    # 45% of their wall time on a CPU. They compute; only the sleeping env (1%) goes to the lanes
    p = profile(n=4, steps=400, wall=0.9, cpu=np.array([0.405, 0.009, 0.405, 0.405]))
    knobs = Knobs("mixed", lanes=2, workers=2, placement=(0, 1, 0, 1), mixed=True)
    p.system = {"cpu_util_mean": 99.0}
    d = backend_rule(p, knobs, Limits(num_units=4, cpus=2), Memory())
    assert d.new == (0, LOCAL, 0, 1) and "cores were 99% busy" in d.reason
    p.system = {"cpu_util_mean": 60.0}  # with idle cores the same 45% is a wait: all four move
    assert backend_rule(p, knobs, Limits(num_units=4, cpus=2), Memory()).new == (LOCAL,) * 4


def test_nothing_moves_without_a_mixed_pool_a_loaded_gil_or_a_second_core():
    p, _ = _mixed_window()
    knobs = Knobs("thread", lanes=16, workers=0, placement=(LOCAL,) * 16, mixed=True)
    assert backend_rule(p, Knobs("thread", lanes=16), Limits(num_units=16, cpus=2), Memory()) is None
    assert backend_rule(p, knobs, Limits(num_units=16, cpus=1), Memory()) is None
    light, _ = _mixed_window(window=4.0)  # the same steps over 4 s: the lanes compute 0.19 of a core
    assert backend_rule(light, knobs, Limits(num_units=16, cpus=2), Memory()) is None
    fixed = Limits(num_units=16, cpus=2, fixed=frozenset({"backend"}))
    assert backend_rule(p, knobs, fixed, Memory()) is None


# ---------------------------------------------------------------- a run


def test_an_auto_run_on_a_mix_of_envs_moves_the_computing_ones_to_workers_and_counts_every_step(monkeypatch):
    """Half the envs sleep (AUTO's probe of env 0 picks lanes for all), half compute in Python
    holding the GIL: the controller moves those to worker processes at their episode ends.

    The computing envs' CPU time reaches the controller as their steps' wall time, what a step
    that computes throughout measures on a core of its own: measured, it is the share of a core
    this machine left them (GIL waits and other processes included), and on a loaded machine
    the decision would follow the load. The sleeping envs' CPU time is measured: a sleep stays
    CPU-idle on any load."""
    computing = [1, 3, 5, 7]

    def env_fn(i):
        if i in computing:
            return MockEnv(dim=3, episode_len=20, latency=Latency.constant(0.0004), latency_mode=LatencyMode.SPIN)
        return MockEnv(dim=3, episode_len=20, latency=Latency.constant(0.002))

    def computing_uses_its_wall_time(costs):
        costs[computing, CPU] = costs[computing, WALL]

    idle_machine_costs(monkeypatch, computing_uses_its_wall_time)
    trainer = ebrl.Trainer(env_fn=env_fn, policy=MockPolicy(act_dim=3), algo=NoopAlgo(),
                           config=ebrl.RunConfig(num_envs=8, segment_len=8, total_env_steps=6000,
                                                 resources={"epoch_s": 0.25}))
    result = ebrl.run_sync(trainer)
    assert result.accounting_ok() and result.dropped == {}
    start, moved = ([d for d in result.decisions if d["knob"] == "backend" and (d["epoch"] >= 0) is later]
                    for later in (False, True))
    assert [(d["old"], d["new"]) for d in start] == [("auto", "thread")]  # the start decision, from env 0
    assert moved and moved[0]["old"] == [LOCAL] * 8
    # only computing envs move (each that stepped enough in the window to be judged)
    to_workers = {i for i, w in enumerate(moved[0]["new"]) if w != LOCAL}
    assert to_workers and to_workers <= set(computing), moved[0]
    if not any("reverted" in d["reason"] for d in moved):
        assert result.sim_backend == "mixed" and result.migrations >= len(to_workers)
    assert sum(result.steps_per_env) == result.env_steps


def test_a_move_decided_from_a_stale_placement_is_skipped(monkeypatch):
    """A decision made while an earlier move was in flight read the old placement, so it may
    ask to move an env to where it already is: that move is skipped, not a crash."""
    import ebrl.runtime.run as run_module
    from ebrl.runtime.driver import Driver

    class StaleMoves(Driver):
        stale: dict | None = None

        def _on_block(self, block):
            if StaleMoves.stale is None and hasattr(self.pool, "placement"):
                StaleMoves.stale = {i: int(w) for i, w in enumerate(self.pool.placement)}  # where each already is
                self.moves.wanted = dict(StaleMoves.stale)
            super()._on_block(block)

    monkeypatch.setattr(run_module, "Driver", StaleMoves)
    trainer = ebrl.Trainer(env_fn=lambda i: MockEnv(dim=3, episode_len=10, latency=Latency.constant(0.001)),
                           policy=MockPolicy(act_dim=3), algo=NoopAlgo(),
                           config=ebrl.RunConfig(num_envs=4, segment_len=8, total_env_steps=800,
                                                 resources={"epoch_s": 10.0}))
    result = ebrl.run_sync(trainer)
    assert StaleMoves.stale == {i: LOCAL for i in range(4)}  # a mixed pool, every env on the lanes
    assert result.accounting_ok() and result.dropped == {} and result.migrations == 0
