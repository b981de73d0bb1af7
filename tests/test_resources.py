"""The resource manager: controller rules over synthetic profiles, and the loop in virtual time."""

import asyncio
import time

import numpy as np
import pytest

import ebrl
from ebrl.runtime.resources.controller import decide
from ebrl.runtime.resources.knobs import Knobs, Limits, Memory
from ebrl.runtime.resources.rules_sim import lanes_rule, lpt_placement, placement_rule, spread
from ebrl.runtime.resources.rules_stages import generation_rule
from ebrl.runtime.resources.rules_start import START
from ebrl.runtime.resources.profiler import WAIT_CAUSES, EpochProfile
from ebrl.runtime.sim.block import STEPS, WALL
from ebrl.testing import Latency, MockEnv, MockPolicy, NoopAlgo, run_virtual



async def act(gen, env_id, obs):
    """One env's action from a generator, awaited: ``(result, row, version)``."""
    fut = asyncio.get_running_loop().create_future()
    gen.request(np.array([env_id]), obs[None], lambda ids, res, lo, hi, v: fut.done() or fut.set_result((res, lo, v)))
    return await fut

def profile(n=16, epoch=0, window=1.0, steps=100.0, wall=0.1, cpu=0.001, lane=0.0, action=0.0, lanes=2,
            backend="thread", placement=None, mean_step=None, gen=None):
    """A synthetic window: every env the same unless arrays are given."""
    arr = lambda x: np.broadcast_to(np.asarray(x, float), (n,)).copy()  # noqa: E731
    waits = {c: np.zeros(n) for c in WAIT_CAUSES}
    waits["lane"], waits["action"] = arr(lane), arr(action)
    p = EpochProfile(epoch=epoch, t_start=0.0, t_end=window, backend=backend, lanes=lanes, num_units=n,
                     steps=arr(steps), wall_s=arr(wall), cpu_s=arr(cpu),
                     mean_step_s=arr(wall) / arr(steps) if mean_step is None else arr(mean_step), waits=waits,
                     placement=None if placement is None else np.asarray(placement))
    for k, v in (gen or {}).items():
        setattr(p, k, v)
    return p


# ---------------------------------------------------------------- lanes


def test_lanes_grow_when_sleeping_envs_wait_for_a_lane_with_a_reason():
    p = profile(wall=0.1, lane=0.8, cpu=0.001)
    d = lanes_rule(p, Knobs("thread", lanes=2), Limits(num_units=16, cpus=2), Memory())
    assert d.knob == "lanes" and d.old == 2 and d.new == 8  # bounded: 4x a step
    assert "waited" in d.reason and "lane" in d.reason


def test_lanes_grow_at_most_to_one_per_unit():
    p = profile(n=4, wall=0.1, lane=0.8)
    d = lanes_rule(p, Knobs("thread", lanes=3), Limits(num_units=4, cpus=2), Memory())
    assert d.new == 4


def test_lanes_do_not_grow_past_what_the_cores_can_step_for_a_busy_env():
    # GIL-bound steps (CPU = wall): more lanes than cores only queue on the GIL
    p = profile(wall=0.1, cpu=0.1, lane=0.8)
    assert lanes_rule(p, Knobs("thread", lanes=2), Limits(num_units=16, cpus=2), Memory()) is None
    # half-busy steps: up to cpus / busy = 4 lanes
    p = profile(wall=0.1, cpu=0.05, lane=0.8)
    assert lanes_rule(p, Knobs("thread", lanes=2), Limits(num_units=16, cpus=2), Memory()).new == 4


def test_lanes_hold_without_lane_waits():
    p = profile(wall=0.5, lane=0.0)  # 16 envs x 0.5 s stepping on 16 lanes: half of them busy
    assert lanes_rule(p, Knobs("thread", lanes=16), Limits(num_units=16, cpus=2), Memory()) is None


def test_lanes_shrink_only_after_two_idle_epochs_and_never_below_where_waits_were_seen():
    limits, memory = Limits(num_units=16, cpus=2), Memory()
    idle = profile(wall=0.05, lane=0.0)  # 0.8 lanes stepping on average of 16
    assert lanes_rule(idle, Knobs("thread", lanes=16), limits, memory) is None  # first vote
    d = lanes_rule(idle, Knobs("thread", lanes=16), limits, memory)
    assert d is not None and d.new == 8  # halved at most
    memory = Memory()
    lanes_rule(profile(wall=0.1, lane=0.8), Knobs("thread", lanes=6), limits, memory)  # waits seen at 6
    for _ in range(3):
        d = lanes_rule(idle, Knobs("thread", lanes=8), limits, memory)
    assert d is None  # 7 would be at most one above 6, the count that was too few: hold


def test_fixed_lanes_are_never_changed():
    p = profile(wall=0.1, lane=0.8)
    limits = Limits(num_units=16, cpus=2, fixed=frozenset({"lanes"}))
    assert decide(p, Knobs("thread", lanes=2), limits, Memory()) == []


def test_a_window_with_too_few_steps_decides_nothing():
    p = profile(steps=1.0, wall=0.1, lane=0.8)
    assert decide(p, Knobs("thread", lanes=2), Limits(num_units=16, cpus=2), Memory()) == []


def test_a_changed_knob_settles_for_a_window_before_it_changes_again():
    memory, limits = Memory(), Limits(num_units=16, cpus=2)
    assert decide(profile(epoch=0, lane=0.8), Knobs("thread", lanes=2), limits, memory)[0].new == 8
    assert decide(profile(epoch=1, lane=0.8), Knobs("thread", lanes=8), limits, memory) == []
    assert decide(profile(epoch=2, lane=0.8), Knobs("thread", lanes=8), limits, memory)[0].new == 16


# ---------------------------------------------------------------- placement


def test_lpt_balances_costs_and_keeps_envs_where_it_can():
    costs = np.array([4.0, 1, 4, 1, 4, 1, 4, 1])
    rr = np.arange(8) % 2  # every costly env on worker 0
    assert spread(costs, rr, 2) == pytest.approx(16 / 10)
    new = lpt_placement(costs, 2, current=rr)
    assert spread(costs, new, 2) == pytest.approx(1.0)
    assert (new == rr).sum() >= 4  # half of the envs stay


def test_placement_moves_envs_off_a_busy_worker():
    costs = np.array([0.004, 0.001] * 4)
    wall = costs * 100  # every env 100 steps (a lockstep schedule): worker 0 busy 1.6 s, worker 1 0.4 s
    p = profile(n=8, steps=100.0, wall=wall, mean_step=costs, backend="process", placement=np.arange(8) % 2,
                window=2.0)
    knobs = Knobs("process", workers=2, placement=tuple((np.arange(8) % 2).tolist()))
    d = placement_rule(p, knobs, Limits(num_units=8, cpus=2), Memory())
    assert d is not None and d.knob == "placement"
    assert spread(costs, np.array(d.new), 2) < spread(costs, np.arange(8) % 2, 2)
    assert "longest first" in d.reason


def test_placement_holds_when_workers_are_equally_busy():
    # async with both workers saturated: the cheap worker spins through its envs, no loss
    costs = np.array([0.004, 0.001] * 4)
    steps = np.where(np.arange(8) % 2 == 0, 50.0, 200.0)
    p = profile(n=8, steps=steps, wall=costs * steps, mean_step=costs, backend="process",
                placement=np.arange(8) % 2)
    knobs = Knobs("process", workers=2, placement=tuple((np.arange(8) % 2).tolist()))
    assert placement_rule(p, knobs, Limits(num_units=8, cpus=2), Memory()) is None


def test_placement_holds_on_saturated_cores_unless_envs_wait_at_a_barrier():
    # worker 0 busy 1.6 s, worker 1 0.4 s, as above, on cores 95% busy
    costs = np.array([0.004, 0.001] * 4)
    knobs = Knobs("process", workers=2, placement=tuple((np.arange(8) % 2).tolist()))

    def window(barrier):
        p = profile(n=8, steps=100.0, wall=costs * 100, mean_step=costs, backend="process",
                    placement=np.arange(8) % 2, window=2.0)
        p.system["cpu_util_mean"] = 95.0
        p.waits["barrier"][:] = barrier
        return p

    assert placement_rule(window(0.0), knobs, Limits(num_units=8, cpus=2), Memory()) is None  # async
    assert placement_rule(window(0.3), knobs, Limits(num_units=8, cpus=2), Memory()).knob == "placement"  # lockstep


def test_a_placement_that_measures_slower_is_reverted_and_its_knob_frozen():
    from ebrl.runtime.resources.controller import FROZEN_EPOCHS, postpone_trials

    rr = tuple((np.arange(8) % 2).tolist())
    costs = np.array([0.004, 0.001] * 4)
    limits, memory = Limits(num_units=8, cpus=2), Memory()

    def window(epoch, steps, placement):
        return profile(n=8, epoch=epoch, steps=steps, wall=costs * steps, mean_step=costs, backend="process",
                       placement=np.array(placement), window=2.0)

    assert decide(window(0, 100.0, rr), Knobs("process", workers=2, placement=rr), limits, memory) == []  # start-up
    [d] = decide(window(1, 100.0, rr), Knobs("process", workers=2, placement=rr), limits, memory)
    assert d.knob == "placement"
    postpone_trials(memory, 2)  # envs still moving at epoch 2: judged at 4, not 3
    placed = Knobs("process", workers=2, placement=d.new)
    assert decide(window(3, 100.0, d.new), placed, limits, memory) == []
    [back] = decide(window(4, 80.0, d.new), placed, limits, memory)  # 20% fewer steps per second
    assert back.knob == "placement" and back.new == rr and back.old == d.new and "reverted" in back.reason
    for epoch in range(5, 4 + FROZEN_EPOCHS):  # the knob is left alone meanwhile
        assert decide(window(epoch, 100.0, rr), Knobs("process", workers=2, placement=rr), limits, memory) == []


def test_a_placement_that_holds_its_throughput_is_kept():
    rr = tuple((np.arange(8) % 2).tolist())
    costs = np.array([0.004, 0.001] * 4)
    memory, limits = Memory(), Limits(num_units=8, cpus=2)
    p = profile(n=8, epoch=1, steps=100.0, wall=costs * 100, mean_step=costs, backend="process",
                placement=np.array(rr), window=2.0)
    [d] = decide(p, Knobs("process", workers=2, placement=rr), limits, memory)
    balanced = profile(n=8, epoch=3, steps=99.0, wall=costs * 99, mean_step=costs, backend="process",
                       placement=np.array(d.new), window=2.0)
    assert decide(balanced, Knobs("process", workers=2, placement=d.new), limits, memory) == []
    assert memory.trials == {}


# ---------------------------------------------------------------- generation


def test_max_wait_halves_when_batches_start_on_the_cap_while_the_generator_idles_and_doubles_when_it_is_busy():
    limits = Limits(num_units=16, cpus=2)
    capped = profile(gen={"gen_batches": 100, "gen_rows": 400, "gen_busy_s": 0.1, "gen_capped": 80})
    d = generation_rule(capped, Knobs("thread", max_wait_s=0.002), limits, Memory())
    assert d.new == pytest.approx(0.001) and "batch-fill" in d.reason
    # the same waits, but the batches ran full or when every env waited: the cap does not bind
    uncapped = profile(gen={"gen_batches": 100, "gen_rows": 400, "gen_busy_s": 0.1, "gen_capped": 10})
    assert generation_rule(uncapped, Knobs("thread", max_wait_s=0.002), limits, Memory()) is None
    busy = profile(gen={"gen_batches": 1000, "gen_rows": 3000, "gen_busy_s": 0.9, "live_envs": 16})
    d = generation_rule(busy, Knobs("thread", max_wait_s=0.002), limits, Memory())
    assert d.new == pytest.approx(0.004) and "fewer policy calls" in d.reason
    assert generation_rule(busy, Knobs("thread", max_wait_s=0.008), limits, Memory()) is None  # at the cap
    fixed = Limits(num_units=16, cpus=2, fixed=frozenset({"max_wait_s"}))
    assert generation_rule(capped, Knobs("thread", max_wait_s=0.002), fixed, Memory()) is None


class Spinning(MockPolicy):
    """A policy whose every call spins ``cpu_s`` of CPU in the calling thread."""

    def __init__(self, act_dim: int, cpu_s: float):
        super().__init__(act_dim=act_dim)
        self.cpu_s = cpu_s

    def act(self, obs):
        end = time.thread_time() + self.cpu_s
        while time.thread_time() < end:
            pass
        return super().act(obs)


def test_policy_calls_move_inline_when_the_generator_thread_waits_for_the_gil_and_back_when_they_grow():
    from ebrl.runtime.resources.rules_stages import offload_rule

    limits = Limits(num_units=16, cpus=2)
    # 100 batches of 100 us CPU that took 400 us each in the thread: they mostly waited
    starved = profile(gen={"gen_batches": 100, "gen_rows": 800, "gen_busy_s": 0.04, "gen_cpu_s": 0.01,
                           "offload": "thread"})
    d = offload_rule(starved, Knobs("thread", offload="thread"), limits, Memory())
    assert (d.old, d.new) == ("thread", "inline") and "GIL" in d.reason
    # the same calls, not waiting: a thread lets the loop deliver meanwhile; keep it
    fine = profile(gen={"gen_batches": 100, "gen_rows": 800, "gen_busy_s": 0.015, "gen_cpu_s": 0.01,
                        "offload": "thread"})
    assert offload_rule(fine, Knobs("thread", offload="thread"), limits, Memory()) is None
    # inline calls of 2 ms CPU each stall the loop: back to the thread
    heavy = profile(gen={"gen_batches": 100, "gen_rows": 800, "gen_busy_s": 0.2, "gen_cpu_s": 0.2,
                         "offload": "inline"})
    assert offload_rule(heavy, Knobs("thread", offload="inline"), limits, Memory()).new == "thread"
    # a window that ran the other way (AUTO moved the calls meanwhile), or a user's choice: nothing
    assert offload_rule(starved, Knobs("thread", offload="inline"), limits, Memory()) is None
    fixed = Limits(num_units=16, cpus=2, fixed=frozenset({"offload"}))
    assert offload_rule(starved, Knobs("thread", offload="thread"), fixed, Memory()) is None


def test_the_controller_resolves_auto_offload_from_the_first_measured_call_on_the_line_it_keeps_after():
    """``generation.offload="auto"``: the first call warms up in the generator's thread, the next
    runs inline and is measured, and the controller's start rule picks from it on the line
    ``generation.inline_below_s``, which its epoch rule keeps too: a call of 500 us CPU stays
    inline in both, and a user's line moves both."""
    import asyncio
    from types import SimpleNamespace

    from ebrl.config import Offload, SimBackend
    from ebrl.runtime.generation import Generator
    from ebrl.runtime.resources.rules_stages import offload_rule
    from ebrl.runtime.resources.manager import ResourceManager

    def manager(gen, line):
        cfg = ebrl.RunConfig(num_envs=16, generation={"inline_below_s": line})
        pool = SimpleNamespace(backend=SimBackend.THREAD, resizable=False, movable=False, size=2, resize=None)
        return ResourceManager(cfg, SimpleNamespace(close=lambda: None), pool, SimpleNamespace(), gen, cpus=2)

    async def modes(line):
        # 500 us of CPU a call: over a 100 us line, under the default 1 ms
        gen = Generator(Spinning(act_dim=2, cpu_s=0.0005), batch_target=1, max_wait_s=0.0, live=1)
        mgr = manager(gen, line)
        server, start = asyncio.create_task(gen.serve()), asyncio.create_task(mgr._start_offload())
        seen = []
        for _ in range(6):
            await act(gen, 0, np.zeros(3, np.float32))
            await asyncio.sleep(0)  # the controller's task runs between calls
            seen.append(gen.offload_mode)
        server.cancel()
        await start
        return seen, [d.to_dict() for d in mgr.decisions]

    default = ebrl.RunConfig().generation.inline_below_s
    seen, decisions = asyncio.run(modes(default))
    assert seen == [Offload.INLINE] * 6  # the warm-up call ran in the thread before the first look
    assert [(d["epoch"], d["knob"], d["old"], d["new"]) for d in decisions] == [(-1, "offload", "auto", "inline")]
    seen, decisions = asyncio.run(modes(100e-6))
    assert seen[0] is Offload.INLINE and seen[-1] is Offload.THREAD  # the measured call ran inline
    assert decisions[0]["new"] == "thread" and "over 0.1 ms" in decisions[0]["reason"]
    # the controller's epoch rule, from the same setting: 500 us inline calls stay; with a 100 us line they go
    inline = profile(gen={"gen_batches": 100, "gen_rows": 800, "gen_busy_s": 0.05, "gen_cpu_s": 0.05,
                          "offload": "inline"})
    for line, moved in ((default, False), (100e-6, True)):
        gen = SimpleNamespace(max_wait_s=0.002, batch_target=8, offload_mode=Offload.INLINE, actuators=dict,
                              stage=SimpleNamespace(threads=True))
        mgr = manager(gen, line)
        assert mgr.limits.inline_up_to_s == line
        d = offload_rule(inline, Knobs("thread", offload="inline"), mgr.limits, Memory())
        assert (d is not None) is moved


def test_batch_target_halves_only_for_an_idle_generator_thread_with_idle_cores_and_doubles_when_calls_are_full():
    from ebrl.runtime.resources.rules_stages import batch_target_rule

    limits = Limits(num_units=16, cpus=2, num_envs=16)
    # rows wait 500 us for batches that take 400 us, the thread busy 40%, half the cores idle
    waiting = {"gen_batches": 1000, "gen_rows": 8000, "gen_busy_s": 0.4, "gen_wait_s": 4.0, "offload": "thread",
               "loop_busy": 0.3, "system": {"cpu_util_mean": 50.0}}
    d = batch_target_rule(profile(gen=waiting), Knobs("thread", batch_target=16), limits, Memory())
    assert (d.old, d.new) == (16, 8) and "generator thread" in d.reason
    # the cores are busy: more calls would take CPU from the sims
    busy_cores = {**waiting, "system": {"cpu_util_mean": 90.0}}
    assert batch_target_rule(profile(gen=busy_cores), Knobs("thread", batch_target=16), limits, Memory()) is None
    # inline, the calls cost the loop that delivers every result: no smaller batches
    inline = {**waiting, "offload": "inline"}
    assert batch_target_rule(profile(gen=inline), Knobs("thread", batch_target=16), limits, Memory()) is None
    # inline with the loop full and batches at the target: fuller batches
    full = {**inline, "gen_rows": 4500, "loop_busy": 0.95}
    d = batch_target_rule(profile(gen=full), Knobs("thread", batch_target=4), limits, Memory())
    assert d.new == 8 and "fewer calls" in d.reason
    assert batch_target_rule(profile(gen=full), Knobs("thread", batch_target=16), limits, Memory()) is None  # all
    # no CPU clock (virtual time), or a user's target: nothing
    virtual = {**waiting, "loop_busy": float("nan")}
    assert batch_target_rule(profile(gen=virtual), Knobs("thread", batch_target=16), limits, Memory()) is None
    fixed = Limits(num_units=16, cpus=2, fixed=frozenset({"batch_target"}))
    assert batch_target_rule(profile(gen=waiting), Knobs("thread", batch_target=16), fixed, Memory()) is None


def test_the_batch_target_follows_the_measured_cost_of_a_call_against_its_rows():
    from ebrl.runtime.generation import BatchCosts
    from ebrl.runtime.resources.rules_stages import batch_target_rule

    limits = Limits(num_units=16, cpus=2, num_envs=16)
    costs = BatchCosts()  # a VLA-like call: 40 ms whatever the batch, 1 ms a row
    for rows in (1, 2, 4, 8, 16):
        costs.add(rows, 0.040 + 0.001 * rows)
    # 100 rows/s: with batches of 16 the thread is busy 35%, and rows wait longer than half a call;
    # the target halves, but not under 10 rows, with which 10 calls/s keep the thread half busy
    # (batches of 8 would need 60% of it)
    waiting = {"gen_batches": 6, "gen_rows": 100, "gen_busy_s": 0.35, "gen_wait_s": 3.0, "offload": "thread",
               "loop_busy": 0.3, "system": {"cpu_util_mean": 50.0}, "gen_fit": costs.fit()}
    d = batch_target_rule(profile(gen=waiting), Knobs("thread", batch_target=16), limits, Memory())
    assert (d.old, d.new) == (16, 10) and "40.00 ms + 1.000 ms a row" in d.reason
    assert batch_target_rule(profile(gen=waiting), Knobs("thread", batch_target=10), limits, Memory()) is None
    d = batch_target_rule(profile(gen=waiting), Knobs("thread", batch_target=4), limits, Memory())  # too small
    assert (d.old, d.new) == (4, 10) and "batches of 10 keep the generator busy under 50%" in d.reason
    # a small MLP's call (80 us + 1 us a row) at the same rate: batching saves nothing, the target halves
    cheap = {**waiting, "gen_fit": (80e-6, 1e-6)}
    assert batch_target_rule(profile(gen=cheap), Knobs("thread", batch_target=16), limits, Memory()).new == 8


def test_the_batch_target_waits_a_window_after_the_calls_move():
    starved = profile(epoch=3, gen={"gen_batches": 1000, "gen_rows": 8000, "gen_busy_s": 0.4, "gen_cpu_s": 0.05,
                                    "gen_wait_s": 4.0, "offload": "thread", "loop_busy": 0.3,
                                    "system": {"cpu_util_mean": 50.0}})
    knobs = Knobs("thread", offload="thread", batch_target=16)
    decided = decide(starved, knobs, Limits(num_units=16, cpus=2, num_envs=16), Memory())
    assert [d.knob for d in decided] == ["offload"]  # the target's window ran with the calls in the thread


def test_worker_processes_multiply_when_their_steps_wait_and_halve_to_the_cores_when_they_compute():
    from ebrl.runtime.resources.rules_sim import workers_rule

    limits = Limits(num_units=16, cpus=2)
    placement = [0, 1] * 8
    # each worker steps 8 envs x 0.12 s = 96% of the window, computing 1% of it (sleeping steps)
    sleeping = profile(wall=0.12, cpu=0.0012, placement=placement)
    d = workers_rule(sleeping, Knobs("process", workers=2, placement=tuple(placement)), limits, Memory())
    assert (d.old, d.new) == (2, 8) and "wait" in d.reason  # bounded: 4x a step
    # computing steps on more workers than cores: back to the cores
    computing = profile(wall=0.03, cpu=0.03, placement=[0, 1, 2, 3, 4, 5, 6, 7] * 2)
    d = workers_rule(computing, Knobs("process", workers=8, placement=tuple([0, 1, 2, 3, 4, 5, 6, 7] * 2)),
                     limits, Memory())
    assert d.new == 4  # halved at most
    # workers with room, or a user's count: nothing
    idle = profile(wall=0.05, cpu=0.0005, placement=placement)
    assert workers_rule(idle, Knobs("process", workers=2, placement=tuple(placement)), limits, Memory()) is None
    fixed = Limits(num_units=16, cpus=2, fixed=frozenset({"workers"}))
    assert workers_rule(sleeping, Knobs("process", workers=2, placement=tuple(placement)), fixed, Memory()) is None
    # steps at 40% of their wall time: a wait while cores idle, a starved compute on saturated cores
    starved = profile(wall=0.12, cpu=0.048, placement=placement)
    starved.system = {"cpu_util_mean": 50.0}
    assert workers_rule(starved, Knobs("process", workers=2, placement=tuple(placement)), limits, Memory()).new == 8
    starved.system = {"cpu_util_mean": 97.0}
    assert workers_rule(starved, Knobs("process", workers=2, placement=tuple(placement)), limits, Memory()) is None
    crowded = profile(wall=0.03, cpu=0.012, placement=[0, 1, 2, 3, 4, 5, 6, 7] * 2)  # 8 workers, 40% each
    crowded.system = {"cpu_util_mean": 100.0}
    d = workers_rule(crowded, Knobs("process", workers=8, placement=tuple([0, 1, 2, 3, 4, 5, 6, 7] * 2)),
                     limits, Memory())
    assert d.new == 4  # they compute, time-sliced: halved


# ---------------------------------------------------------------- the loop, in virtual time


def _sleepers(**config):
    return ebrl.Trainer(
        env_fn=lambda i: MockEnv(latency=Latency.lognormal(0.001, 1.0)),
        policy=MockPolicy(act_dim=4, base_cost_s=0.0003), algo=NoopAlgo(base_cost_s=0.005),
        config=ebrl.RunConfig(**{"num_envs": 16, "segment_len": 16, "total_env_steps": 30_000, **config}))


def test_a_window_grows_until_it_holds_a_few_steps_per_env_and_no_longer_than_its_cap():
    from ebrl.runtime.resources.knobs import MAX_WINDOW_EPOCHS, MIN_STEPS_PER_UNIT

    # 8 envs of 0.3 s steps on 2 lanes to start: a 0.5 s epoch holds at most 13 steps, under the 32 a window needs
    slow = ebrl.Trainer(env_fn=lambda i: MockEnv(latency=Latency.constant(0.3)),
                        policy=MockPolicy(act_dim=4, base_cost_s=0.0003), algo=NoopAlgo(base_cost_s=0.005),
                        config=ebrl.RunConfig(num_envs=8, segment_len=16, total_env_steps=800,
                                              resources={"epoch_s": 0.5}))
    result = run_virtual(slow)
    assert result.accounting_ok() and sum(p["sim"]["steps"] for p in result.profiles) == result.env_steps
    whole = result.profiles[:-1]  # the last is the run's partial end
    assert len(whole) >= 3
    for p in whole:
        window = p["t_end"] - p["t_start"]
        assert p["sim"]["steps"] >= MIN_STEPS_PER_UNIT * 8 and 1.0 <= window <= 0.5 * MAX_WINDOW_EPOCHS + 1e-6
        assert window == pytest.approx(round(window / 0.5) * 0.5, abs=1e-3)  # a whole number of epochs


def test_a_window_in_which_an_update_holds_the_envs_closes_at_once():
    from ebrl.runtime.resources.knobs import MIN_STEPS_PER_UNIT

    # slow steps grow the windows; a 4 s update under sync holds every env (the generator pauses)
    slow = ebrl.Trainer(env_fn=lambda i: MockEnv(latency=Latency.constant(0.3)),
                        policy=MockPolicy(act_dim=4, base_cost_s=0.0003), algo=NoopAlgo(base_cost_s=4.0),
                        config=ebrl.RunConfig(num_envs=8, segment_len=16, total_env_steps=512, schedule="sync",
                                              sim={"num_threads": 8}, resources={"epoch_s": 0.5}))
    result = run_virtual(slow)
    assert result.accounting_ok()
    held = [p for p in result.profiles[:-1] if p["learner"]["held_envs"] > 0.95]
    assert len(held) >= 8  # the updates' windows: one epoch each, not one grown window
    for p in held:
        assert p["t_end"] - p["t_start"] == pytest.approx(0.5, abs=1e-3)
        assert p["sim"]["steps"] < MIN_STEPS_PER_UNIT * 8  # stalled: only the stall rules judge it
    grown = [p for p in result.profiles[:-1] if p["t_end"] - p["t_start"] > 0.75]
    assert grown and all(p["learner"]["held_envs"] < 0.95 for p in grown)


def test_sleeping_envs_converge_to_enough_lanes_within_three_epochs():
    # 2 lanes to start with (virtual time's probe: a declared step is a core's work, on 2 cores that start
    # no processes); 20k steps: the three epochs and a settled one
    result = run_virtual(_sleepers(total_env_steps=20_000))
    start = [(d["knob"], d["new"]) for d in result.decisions if d["epoch"] == START]
    assert start == [("backend", "thread"), ("lanes", 2), ("learner", "thread")]
    assert result.accounting_ok()
    assert result.sim_size == 16
    settled = [p["epoch"] for p in result.profiles if p["sim"]["lanes"] == 16][0]
    assert settled <= 3
    assert all(p["sim"]["lanes"] == 16 for p in result.profiles[settled:])
    assert result.profiles[-2]["sim"]["lane_wait_share"] < 0.05
    assert {d["knob"] for d in result.decisions if d["epoch"] != START} == {"lanes"}
    # lanes only grew, and the run beat the same run with the controller off
    fixed = run_virtual(_sleepers(total_env_steps=10_000, resources={"adapt": False}))  # its rate is steady
    assert all(d["epoch"] == START for d in fixed.decisions) and fixed.sim_size == 2 and len(fixed.profiles) > 3
    assert result.env_steps_per_s > 3 * fixed.env_steps_per_s


def test_a_run_reports_the_cost_curve_of_its_policy_calls():
    trainer = _sleepers(total_env_steps=3_000)
    trainer.policy = MockPolicy(act_dim=4, base_cost_s=0.004, per_item_cost_s=0.0005)
    result = run_virtual(trainer)
    costs = result.gen_costs
    assert len(costs["calls"]) >= 2 and sum(costs["calls"].values()) == sum(result.gen_batch_hist.values()) - 1
    assert costs["fixed_us"] == pytest.approx(4000, rel=1e-3) and costs["per_row_us"] == pytest.approx(500, rel=1e-3)
    assert result.profiles[-1]["generation"]["fixed_us"] == costs["fixed_us"]


def test_explicit_lanes_are_kept():
    result = run_virtual(_sleepers(total_env_steps=10_000, sim={"num_threads": 3}))  # six windows
    assert "lanes" not in {d["knob"] for d in result.decisions} and result.sim_size == 3
    assert all(p["sim"]["lanes"] == 3 for p in result.profiles)


def test_profiles_account_for_every_step_and_the_time_of_every_env():
    result = run_virtual(_sleepers(total_env_steps=6000))
    assert sum(p["sim"]["steps"] for p in result.profiles) == result.env_steps
    for p in result.profiles[1:-1]:
        # every env is, at each moment, stepping or in one waiting state
        share = p["sim"]["share"] + sum(p["waits_share"].values())
        assert share == pytest.approx(1.0, abs=0.02)


# ---------------------------------------------------------------- GPU: the SM split, and the streams' wiring


def test_sm_split_follows_each_sides_busy_time_on_two_windows_in_a_row():
    from ebrl.runtime.resources.rules_stages import sm_split_rule

    limits = Limits(num_units=16, cpus=2, total_sms=132, sm_granularity=8)
    knobs = Knobs("thread", gen_sms=32)

    def window(epoch, gen_busy, train_busy):
        return profile(epoch=epoch, gen={"gen_batches": 10, "gen_busy_s": gen_busy, "updates": 1,
                                         "learner_busy_s": train_busy})

    # training saturated, generation busy a third of the window on a quarter of the SMs: 128 * 10.7/106.7 -> 16
    memory = Memory()
    assert sm_split_rule(window(1, 1 / 3, 1.0), knobs, limits, memory) is None  # one window is not yet a trend
    d = sm_split_rule(window(2, 0.25, 1.0), knobs, limits, memory)
    assert d.knob == "gen_sms" and d.new == 16 and "in proportion" in d.reason and "training gets 112" in d.reason
    # a window that wants generation to grow, then one that wants it to shrink: no move
    memory = Memory()
    assert sm_split_rule(window(1, 1.0, 0.25), knobs, limits, memory) is None
    assert sm_split_rule(window(2, 0.25, 1.0), knobs, limits, memory) is None
    # two that want it to grow, by different amounts: the nearer one (at most doubled: 64)
    assert sm_split_rule(window(3, 1.0, 0.5), knobs, limits, memory) is None  # wants 48
    assert sm_split_rule(window(4, 1.0, 0.25), knobs, limits, memory).new == 48
    # a window in which one side did not run breaks the run of windows
    memory = Memory()
    assert sm_split_rule(window(1, 1 / 3, 1.0), knobs, limits, memory) is None
    assert sm_split_rule(window(2, 1.0, 0.0), knobs, limits, memory) is None  # nothing to train on yet
    assert sm_split_rule(window(3, 1 / 3, 1.0), knobs, limits, memory) is None
    assert sm_split_rule(window(2, 1 / 3, 1.0), Knobs("thread", gen_sms=None), limits, Memory()) is None


class FakeStreams:
    """Records which stream each call ran on (the real GpuStreams needs CUDA)."""

    def __init__(self):
        import contextlib

        self.calls, self.current = [], None

        @contextlib.contextmanager
        def on(name):
            self.current = name
            try:
                yield
            finally:
                self.current = None

        self.generation = lambda: on("generation")
        self.training = lambda: on("training")

    def publish(self):
        self.calls.append(("publish", self.current))
        return "event"

    def wait_published(self, event):
        self.calls.append(("wait", event))


def test_policy_calls_run_on_the_generation_stream_and_new_weights_wait_for_the_training_event():
    import asyncio

    from ebrl.runtime.generation import Generator

    streams = FakeStreams()

    class Policy(MockPolicy):
        def act(self, obs):
            streams.calls.append(("act", streams.current))
            return super().act(obs)

        def load_state_dict(self, state):
            streams.calls.append(("load", streams.current))

    async def go():
        gen = Generator(Policy(act_dim=2), batch_target=1, max_wait_s=0.0, live=1, streams=streams)
        server = asyncio.create_task(gen.serve())
        await act(gen, 0, np.zeros(3, np.float32))
        gen.publish({}, 1, event=streams.publish())
        _, _, version = await act(gen, 0, np.zeros(3, np.float32))
        server.cancel()
        return version

    assert asyncio.run(go()) == 1
    assert streams.calls == [("act", "generation"), ("publish", None), ("wait", "event"),
                             ("load", "generation"), ("act", "generation")]


def test_the_generator_counts_the_cpu_time_of_its_calls_inline_and_in_its_thread():
    import asyncio

    from ebrl.config import Offload
    from ebrl.runtime.generation import Generator

    async def go(offload):
        gen = Generator(Spinning(act_dim=2, cpu_s=0.002), batch_target=1, max_wait_s=0.0, live=1, offload=offload)
        server = asyncio.create_task(gen.serve())
        modes = [gen.offload_mode]
        for _ in range(3):
            await act(gen, 0, np.zeros(3, np.float32))
            modes.append(gen.offload_mode)
        server.cancel()
        return gen.stage.cpu_s, modes

    for offload in (Offload.INLINE, Offload.THREAD):
        cpu, modes = asyncio.run(go(offload))
        assert cpu >= 3 * 0.002 and set(modes) == {offload}
    # AUTO: the first call in the thread, then inline and measured; only the controller moves it
    _, modes = asyncio.run(go(Offload.AUTO))
    assert modes == [Offload.THREAD, Offload.INLINE, Offload.INLINE, Offload.INLINE]


# ---------------------------------------------------------------- migrations, on real worker processes


def idle_machine_costs(monkeypatch, fix):
    """``SimPool.costs`` (per env: steps, wall, CPU and queue seconds, which the controller's
    profiles read) passed through ``fix(costs)``, which writes in the times these envs' steps
    take on an idle machine: an injected clock for the steps, so that a test of a decision made
    from them does not decide by the load of the machine it runs on. Step counts stay real."""
    from ebrl.runtime.sim import SimPool

    costs = SimPool.costs

    def injected(pool):
        out = costs(pool)
        if out is not None:
            fix(out)
        return out

    monkeypatch.setattr(SimPool, "costs", injected)


def test_measured_placement_migrates_envs_at_episode_ends_and_keeps_the_accounting_exact(monkeypatch):
    """Sync schedule, 8 sleeping envs on 2 workers, the 4 slow ones all on worker 0 round-robin:
    worker 1 idles at every barrier, so the controller places by cost and envs move, each at an
    episode end, rebuilt in its new worker. Every step is still counted once.

    The steps' wall times reach the controller as their sleeps (an injected clock): measured, a
    loaded machine adds its wake-up delays to every sleep, and the decision would follow the load.
    How much the measured placement gains is the controller bench's ``placement/round-robin``
    (bench/suites/controller.py)."""
    slow = {0, 2, 4, 6}
    latency = np.array([0.006 if i in slow else 0.0005 for i in range(8)])

    def sleeps(costs):
        costs[:, WALL] = costs[:, STEPS] * latency

    idle_machine_costs(monkeypatch, sleeps)
    trainer = ebrl.Trainer(
        env_fn=lambda i: MockEnv(dim=3, episode_len=8, latency=Latency.constant(latency[i])),
        policy=MockPolicy(act_dim=3), algo=NoopAlgo(),
        config=ebrl.RunConfig(num_envs=8, segment_len=8, total_env_steps=1600, schedule="sync",
                              sim={"backend": "process", "num_workers": 2}, resources={"epoch_s": 0.25}))
    result = ebrl.run_sync(trainer)
    assert result.accounting_ok() and result.dropped == {}
    placed = [d for d in result.decisions if d["knob"] == "placement"]
    assert placed and placed[0]["old"] == [0, 1] * 4
    new = np.array(placed[0]["new"])
    assert sorted(np.bincount(new[list(slow)], minlength=2).tolist()) == [2, 2]  # two slow envs per worker
    # the first placement's moves all happen (nothing is decided while envs wait to move); a later
    # one (a revert, if the measured env steps/s fell) may still wait for episode ends when the run ends
    first = sum(a != b for a, b in zip(placed[0]["old"], placed[0]["new"]))
    decided = sum(a != b for d in placed for a, b in zip(d["old"], d["new"]))
    assert 0 < first <= result.migrations <= decided
    if result.migrations == decided:
        assert result.profiles[-1]["sim"]["placement"] == placed[-1]["new"]
    assert sum(result.steps_per_env) == result.env_steps


def test_sleeping_envs_on_too_few_workers_get_more_and_move_there_with_every_step_counted(monkeypatch):
    """The issue's case: steps that sleep, put on worker processes (which step their envs one
    after another). The controller forks more workers, off the loop, and moves envs there at
    their episode ends; every step is counted once.

    The workers reach the controller as busy through every window, as the driver keeps them on
    an idle machine: measured, on a loaded machine the driver feeds them late and they idle, and
    the decision would follow the load. Their CPU time (a sleep's: little) is measured."""
    from ebrl.runtime.resources.profiler import LiveProfiler

    take = LiveProfiler.take

    def busy_workers(profiler):
        p = take(profiler)
        if p.placement is not None:  # each worker stepped its envs back to back, shared by their steps
            on = np.asarray(p.placement)
            per_worker = np.bincount(on, weights=p.steps, minlength=max(p.workers, 1))
            with np.errstate(invalid="ignore", divide="ignore"):
                p.wall_s = np.where(p.steps > 0, p.window_s * p.steps / per_worker[on], 0.0)
        return p

    monkeypatch.setattr(LiveProfiler, "take", busy_workers)
    trainer = ebrl.Trainer(
        env_fn=lambda i: MockEnv(dim=3, episode_len=8, latency=Latency.constant(0.004)),
        policy=MockPolicy(act_dim=3), algo=NoopAlgo(),
        config=ebrl.RunConfig(num_envs=8, segment_len=8, total_env_steps=3000, sim={"backend": "process"},
                              resources={"epoch_s": 0.25}))
    result = ebrl.run_sync(trainer)
    assert result.accounting_ok() and result.dropped == {}
    grown = [d for d in result.decisions if d["knob"] == "workers"]
    assert grown and grown[0]["new"] > grown[0]["old"] and "wait" in grown[0]["reason"]
    assert result.migrations > 0
    # envs ran on the new workers (a revert, if the measured env steps/s fell, may move them back)
    assert any(max(p["sim"]["placement"]) >= grown[0]["old"] for p in result.profiles)
    if not any("reverted" in d["reason"] for d in grown):
        assert result.sim_size == grown[-1]["new"]
    assert sum(result.steps_per_env) == result.env_steps


def test_fewer_workers_retire_only_after_their_envs_have_moved_off():
    from types import SimpleNamespace

    from ebrl.config import Offload, SimBackend
    from ebrl.runtime.resources.knobs import Decision
    from ebrl.runtime.driver.recovery import Moves
    from ebrl.runtime.resources.manager import ResourceManager

    class Pool:  # the surface of a pool whose envs move between workers, no envs
        backend, resizable, mixed, movable, workers = SimBackend.PROCESS, False, False, True, 4
        placement = np.array([0, 1, 2, 3] * 2)
        resized = []

        def migrate(self, *a):
            raise AssertionError("the driver migrates, at episode ends")

        def resize_workers(self, n):
            self.resized.append(n)
            self.workers = n

    cfg = ebrl.RunConfig(num_envs=8, sim={"backend": "process"})
    pool = Pool()
    driver = SimpleNamespace(moves=Moves(pool, None, None))
    gen = SimpleNamespace(max_wait_s=0.002, batch_target=8, offload_mode=Offload.INLINE, actuators=dict,
                          stage=SimpleNamespace(threads=True))
    profiler = SimpleNamespace(take=lambda: profile(n=8, placement=pool.placement), close=lambda: None)
    mgr = ResourceManager(cfg, profiler, pool, driver, gen, cpus=2)
    mgr.profiles.append(profile(n=8, mean_step=[4, 1, 1, 1, 1, 1, 1, 1], placement=pool.placement))
    mgr._apply(Decision(3, "workers", 4, 2, "test"))
    # every env on workers 2 and 3 moves, to 0 or 1 (others may move too: balanced by cost)
    assert set(driver.moves.wanted) >= {2, 3, 6, 7} and set(driver.moves.wanted.values()) <= {0, 1}
    mgr.epoch()
    assert pool.resized == []  # envs still due to move: the workers keep them
    pool.placement = np.array([0, 1, 0, 1] * 2)
    driver.moves.wanted = {}
    # the epoch that retires decides nothing: knobs read before it counted workers that are gone,
    # and a placement from them once sent an env to a retired worker ("no worker 2: the pool has 2")
    assert mgr.epoch() == []
    assert pool.resized == [2] and mgr.knobs.workers == 2


# ---------------------------------------------------------------- learner threads and CPU affinity


def test_the_learner_gets_a_thread_more_when_training_holds_envs_back_and_cores_idle():
    from ebrl.runtime.resources.rules_stages import threads_rule

    n = 16
    waits = profile(n=n)
    waits.waits["backpressure"] = np.full(n, 0.4)  # envs parked 40% of the window
    waits.learner_busy_s, waits.system = 0.9, {"cpu_util_mean": 50.0}
    d = threads_rule(waits, Knobs("process", learner_threads=1), Limits(num_units=n, cpus=4), Memory())
    assert d.knob == "learner_threads" and (d.old, d.new) == (1, 2) and "held the envs back 40%" in d.reason
    waits.system = {"cpu_util_mean": 95.0}  # no idle core to give it
    assert threads_rule(waits, Knobs("process", learner_threads=1), Limits(num_units=n, cpus=4), Memory()) is None
    assert threads_rule(waits, Knobs("process", learner_threads=None), Limits(num_units=n, cpus=4), Memory()) is None


def test_an_update_longer_than_the_window_gets_its_thread_in_the_window_it_stalls():
    # a 30 s update on a big policy: the windows it spans ran no env step, the envs parked (or,
    # under sync, waited on the paused generator); the learner's rule still runs there, and a
    # change on trial is not judged on such a window (its rate says nothing about the change)
    from ebrl.runtime.resources.controller import decide
    from ebrl.runtime.resources.knobs import Decision, Trial

    n = 8
    stalled = profile(n=n, epoch=3, steps=0.0, mean_step=0.01)
    stalled.learner_busy_s, stalled.gen_paused_s, stalled.system = 1.0, 1.0, {"cpu_util_mean": 50.0}
    memory = Memory()
    memory.trials["batch_target"] = Trial(Decision(0, "batch_target", 8, 4, "x"), rate_before=40.0, judge_at=0)
    out = decide(stalled, Knobs("thread", learner_threads=1, batch_target=4), Limits(num_units=n, cpus=2), memory)
    assert [(d.knob, d.new) for d in out] == [("learner_threads", 2)] and "held the envs back 100%" in out[0].reason
    assert "batch_target" in memory.trials  # still on trial, judged on a window that ran


def test_the_profile_counts_an_update_and_a_park_still_in_progress():
    import asyncio

    from ebrl.runtime.generation import Generator
    from ebrl.testing import MockPolicy

    from ebrl.runtime.stage import Stage

    stage = Stage("learner")  # busy_until_now's arithmetic, as the profiler reads the learner's
    stage.busy_s, stage._started = 2.0, 10.0
    assert stage.busy_until_now(12.5) == 4.5

    async def paused() -> tuple[float, float]:
        gen = Generator(MockPolicy(act_dim=1), batch_target=1, max_wait_s=0.0)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await gen.pause()
        await asyncio.sleep(0.05)
        during = gen.paused_until_now(loop.time())
        gen.resume()
        return during, gen.paused_s, loop.time() - t0

    during, total, span = asyncio.run(paused())
    assert 0.05 <= during <= total <= span


def test_affinity_splits_the_cores_only_when_each_part_can_have_its_own():
    from ebrl.runtime.resources.affinity import split_plan
    from ebrl.runtime.resources.rules_stages import affinity_rule

    assert split_plan(8, 2) == {"loop": [0], "learner": [1], "workers": [2, 3, 4, 5, 6, 7]}
    assert split_plan([2, 3, 5, 7], 2) == {"loop": [2], "learner": [3], "workers": [5, 7]}
    assert split_plan(3, 2) is None and split_plan(2, 2) is None
    p = profile()
    d = affinity_rule(p, Knobs("process", workers=2, affinity="shared"), Limits(num_units=16, cpus=8), Memory())
    assert (d.old, d.new) == ("shared", "split") and "event loop" in d.reason
    assert affinity_rule(p, Knobs("process", workers=2, affinity="shared"), Limits(num_units=16, cpus=2), Memory()) is None
    assert affinity_rule(p, Knobs("process", workers=2, affinity=None), Limits(num_units=16, cpus=8), Memory()) is None


def test_pin_sets_every_thread_of_a_process():
    import os
    import threading

    from ebrl.runtime.resources.affinity import pin, threads_of

    calls, started, stop = [], threading.Event(), threading.Event()
    t = threading.Thread(target=lambda: (started.set(), stop.wait()))
    t.start()
    started.wait()
    try:
        assert pin(os.getpid(), [0], setaffinity=lambda tid, cores: calls.append((tid, cores))) >= 2
        assert {tid for tid, _ in calls} == set(threads_of(os.getpid())) and t.native_id in {c[0] for c in calls}
        assert all(cores == {0} for _, cores in calls)
    finally:
        stop.set()
        t.join()


class ThreadsAlgo:
    """Reports the learner process's torch threads as a metric."""

    def update(self, policy, batch):
        import torch

        return {"threads": torch.get_num_threads()}


def test_learner_threads_reach_the_learner_process_with_the_next_update():
    from types import SimpleNamespace

    import torch

    from ebrl.runtime.learner_process import LearnerProcess

    policy, algo = torch.nn.Linear(2, 2), ThreadsAlgo()
    remote = LearnerProcess(policy, algo, torch_threads=1)
    try:
        batch = SimpleNamespace(lags=torch.zeros(1))
        assert remote.update(batch)[0]["threads"] == 1
        assert remote.update(batch, threads=2)[0]["threads"] == 2
        assert remote.update(batch)[0]["threads"] == 2  # kept until changed again
    finally:
        remote.close(policy, SimpleNamespace(load_state_dict=lambda state: None))


def test_a_timeline_does_not_change_the_profiles_waits():
    """The barrier is its own cause in the profile whether or not a timeline observes the run
    (the timeline's "act" spans the barrier; the profile's action wait does not)."""
    from ebrl.telemetry.timeline import Timeline

    def run(timeline):
        trainer = ebrl.Trainer(
            env_fn=lambda i: MockEnv(latency=Latency.constant(0.010 if i == 0 else 0.001)),
            policy=MockPolicy(act_dim=4, base_cost_s=0.0005), algo=NoopAlgo(base_cost_s=0.002),
            config=ebrl.RunConfig(num_envs=4, segment_len=8, total_env_steps=2000, schedule="sync",
                                  sim={"num_threads": 4}, resources={"epoch_s": 0.5}))
        return run_virtual(trainer, timeline=timeline).profiles

    plain, observed = run(None), run(Timeline())
    assert plain[1]["waits_share"]["barrier"] > 0.3  # the fast envs wait for env 0
    assert [p["waits_share"] for p in plain] == [p["waits_share"] for p in observed]


def test_on_saturated_cores_the_batch_fills_to_half_the_envs_once_and_off_trial():
    from ebrl.runtime.resources.rules_stages import batch_target_rule

    limits = Limits(num_units=16, cpus=2, num_envs=16)
    # ManiSkill-like: two worker processes and the loop keep both cores busy; batches of about one row
    saturated = {"gen_batches": 7000, "gen_rows": 7500, "gen_busy_s": 0.1, "gen_cpu_s": 0.1, "gen_wait_s": 0.1,
                 "offload": "inline", "loop_busy": 0.35, "system": {"cpu_util_mean": 99.0}}
    memory = Memory()
    d = batch_target_rule(profile(epoch=1, gen=saturated), Knobs("process", batch_target=16), limits, memory)
    assert (d.old, d.new, d.trial) == (16, 8, False) and "99% busy" in d.reason
    # once a run: back at every env (another rule's doubling), it is not lowered again
    assert batch_target_rule(profile(epoch=9, gen=saturated), Knobs("process", batch_target=16), limits, memory) is None
    # a call whose cost curve needs more rows than half the envs gets them
    vla = {**saturated, "gen_batches": 6, "gen_rows": 100, "gen_fit": (0.040, 0.001), "offload": "thread"}
    assert batch_target_rule(profile(epoch=1, gen=vla), Knobs("thread", batch_target=16), limits, Memory()).new == 10
    # idle cores, epoch 0 (start-up), or a user's target: nothing
    for gen, epoch, lim in (({**saturated, "system": {"cpu_util_mean": 60.0}}, 1, limits), (saturated, 0, limits),
                            (saturated, 1, Limits(num_units=16, cpus=2, num_envs=16, fixed=frozenset({"batch_target"})))):
        assert batch_target_rule(profile(epoch=epoch, gen=gen), Knobs("process", batch_target=16), lim, Memory()) is None
    # decide() applies it without a trial: a noisy window cannot undo it
    memory = Memory()
    decided = decide(profile(epoch=1, gen=saturated), Knobs("process", batch_target=16), limits, memory)
    assert "batch_target" in [d.knob for d in decided] and "batch_target" not in memory.trials


def test_a_batch_target_under_the_live_envs_fills_at_the_measured_request_rate():
    from ebrl.runtime.generation import FILL_WAIT_MAX_S, Generator
    from ebrl.virtual_time import VirtualTimeLoop

    async def batches(target: int, rows_per_s: float, rows: int, gap: float) -> dict:
        gen = Generator(MockPolicy(act_dim=2), batch_target=target, max_wait_s=0.002, live=4)
        gen.rows_per_s = rows_per_s
        server = asyncio.create_task(gen.serve())
        for _ in range(rows):  # one row every ``gap`` seconds
            gen.request(np.array([0]), np.zeros((1, 3), np.float32), lambda *a: None)
            await asyncio.sleep(gap)
        await asyncio.sleep(0.2)
        server.cancel()
        return dict(gen.batch_sizes)

    def run(*args) -> dict:
        with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
            return runner.run(batches(*args))

    # a target of 2 at 50 rows/s: 2 rows take 40 ms, so a row waits 20 ms for the next
    assert run(2, 50.0, 4, 0.020) == {2: 2}
    # the same with no target below the live envs: each row goes at once (about a batch's time)
    assert run(4, 50.0, 4, 0.020) == {1: 4}
    # a slow rate: the wait stops at FILL_WAIT_MAX_S, 50 ms (rows 30 ms apart, a target of 3)
    assert FILL_WAIT_MAX_S == 0.05 and run(3, 1.0, 4, 0.030) == {2: 2}
