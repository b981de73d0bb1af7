"""The stage timeline (ebrl.telemetry.timeline) on virtual time: exact event counts and durations."""

import dataclasses
import json
import statistics

import pytest

import ebrl
from ebrl.telemetry.timeline import Timeline
from ebrl.testing import Latency, MockEnv, MockPolicy, NoopAlgo, run_virtual

FAST, SLOW = 0.001, 0.010
NUM_ENVS = 8


def latency(i: int) -> float:
    return SLOW if i == 0 else FAST


def traced(schedule: str, total: int = 1600, **cfg):
    trainer = ebrl.Trainer(
        env_fn=lambda i: MockEnv(latency=Latency.constant(latency(i))),
        policy=MockPolicy(act_dim=4, base_cost_s=0.0005),
        algo=NoopAlgo(base_cost_s=0.002),
        # one sim lane per env: a step's "sim" time is then its own latency, no queueing for a lane
        config=ebrl.RunConfig(num_envs=NUM_ENVS, segment_len=16, total_env_steps=total, schedule=schedule,
                              sim={"num_threads": NUM_ENVS}, **cfg),
    )
    timeline = Timeline()
    return run_virtual(trainer, timeline=timeline), timeline


def events(timeline: Timeline, lane: str | None = None, name: str | None = None):
    return [e for e in timeline.events if (lane is None or e[0] == lane) and (name is None or e[1] == name)]


@pytest.fixture(scope="module", params=["async", "sync", "pipelined"])
def run_and_timeline(request):
    return request.param, *traced(request.param)


def test_one_sim_event_per_env_step_lasting_the_env_latency(run_and_timeline):
    schedule, res, tl = run_and_timeline
    assert res.accounting_ok()
    sims = events(tl, name="sim")
    assert len(sims) == res.env_steps == 1600
    for i in range(NUM_ENVS):
        mine = events(tl, f"env {i}", "sim")
        assert len(mine) == res.steps_per_env[i]
        for _, _, t0, t1, _ in mine:
            assert t1 - t0 == pytest.approx(latency(i), abs=1e-9)
    assert {e[0] for e in sims} == {f"env {i}" for i in range(NUM_ENVS)}


def test_generator_batches_sum_to_the_actions_generated(run_and_timeline):
    schedule, res, tl = run_and_timeline
    batches = events(tl, "generator", "batch")
    assert len(batches) == sum(res.gen_batch_hist.values())
    actions = sum(size * n for size, n in res.gen_batch_hist.items())
    assert sum(e[4] for e in batches) == actions == res.env_steps  # every action was simulated
    for _, _, t0, t1, size in batches:
        assert t1 - t0 == pytest.approx(0.0005, abs=1e-9)  # MockPolicy's base cost, in virtual time
    assert set(events(tl, "generator")) == set(batches)


def test_learner_records_one_update_per_update(run_and_timeline):
    schedule, res, tl = run_and_timeline
    updates = events(tl, "learner", "update")
    assert res.updates > 0
    assert len(updates) == res.updates
    assert sum(e[4] for e in updates) == res.trained
    for _, _, t0, t1, _ in updates:
        assert t1 - t0 == pytest.approx(0.002, abs=1e-9)  # NoopAlgo's base cost
    assert res.busy["learner"] == pytest.approx(tl.busy("learner") / res.wall_s, rel=1e-6)


def test_busy_fractions_in_the_result(run_and_timeline):
    schedule, res, tl = run_and_timeline
    assert set(res.busy) == {"generator", "learner", "sim"}
    # mean over envs of (steps * latency) / wall: the sim lanes are busy exactly while stepping
    expected = statistics.fmean(n * latency(i) for i, n in enumerate(res.steps_per_env)) / res.wall_s
    assert res.busy["sim"] == pytest.approx(expected, rel=1e-6)
    assert res.busy["generator"] == pytest.approx(len(events(tl, "generator")) * 0.0005 / res.wall_s, rel=1e-6)
    assert all(0 < v <= 1 for v in res.busy.values())
    json.dumps(dataclasses.asdict(res))  # no Timeline inside: still serialisable


def test_sync_barrier_shows_as_fast_envs_waiting_as_long_as_the_slow_env_steps():
    res, tl = traced("sync")
    slow_sim = statistics.median(t1 - t0 for _, _, t0, t1, _ in events(tl, "env 0", "sim"))
    assert slow_sim == pytest.approx(SLOW)
    for i in range(1, NUM_ENVS):
        waits = [t1 - t0 for _, _, t0, t1, _ in events(tl, f"env {i}", "act")]
        # ready after 1 ms, then held until env 0's 10 ms step ends, then one policy batch
        assert statistics.median(waits) == pytest.approx(SLOW - FAST + 0.0005, rel=0.05)
    # the fast envs simulate ~10% of the time; env 0 most of it
    assert tl.busy_fraction("env 1", name="sim") < 0.15
    assert tl.busy_fraction("env 0", name="sim") > 0.8


def test_async_has_no_barrier_fast_envs_wait_much_less_than_a_slow_step():
    res, tl = traced("async")
    for i in range(1, NUM_ENVS):
        waits = [t1 - t0 for _, _, t0, t1, _ in events(tl, f"env {i}", "act")]
        assert statistics.median(waits) < 0.3 * SLOW
    assert tl.busy_fraction("env 1", name="sim") > 0.4


def test_no_timeline_still_reports_generator_and_learner_busy():
    trainer = ebrl.Trainer(env_fn=lambda i: MockEnv(latency=Latency.constant(FAST)),
                           policy=MockPolicy(act_dim=4, base_cost_s=0.0005), algo=NoopAlgo(base_cost_s=0.002),
                           config=ebrl.RunConfig(num_envs=4, segment_len=8, total_env_steps=400))
    res = run_virtual(trainer)
    assert set(res.busy) == {"generator", "learner"}
    assert res.busy["learner"] == pytest.approx(res.updates * 0.002 / res.wall_s, rel=1e-6)


def test_chrome_trace_is_valid_json_with_named_lanes(tmp_path):
    res, tl = traced("sync", total=320)
    path = tmp_path / "trace.json"
    tl.to_chrome_trace(path)
    trace = json.loads(path.read_text())
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"]
    tid = {e["args"]["name"]: e["tid"] for e in meta}
    assert {"generator", "learner", "env 0", "env 7"} <= set(tid)
    # generator, learner, then envs in numeric order
    assert sorted(tid, key=tid.get) == ["generator", "learner"] + [f"env {i}" for i in range(NUM_ENVS)]
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(tl)
    sims = [e for e in complete if e["name"] == "sim" and e["tid"] == tid["env 0"]]
    assert len(sims) == res.steps_per_env[0]
    assert all(e["dur"] == pytest.approx(SLOW * 1e6, abs=1e-2) and e["ts"] >= 0 for e in sims)
    batches = [e for e in complete if e["name"] == "batch"]
    assert all(e["tid"] == tid["generator"] and e["args"]["batch_size"] == NUM_ENVS for e in batches)


def test_gantt_png(tmp_path):
    _, tl = traced("sync", total=320)
    path = tmp_path / "gantt.png"
    tl.plot_gantt(path, title="sync, env 0 10x slower")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 5_000
    window = tmp_path / "window.png"
    tl.plot_gantt(window, start=0.05, end=0.1, max_envs=2)
    assert window.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_busy_unions_overlaps_clips_and_averages_per_lane():
    tl = Timeline()
    tl.record("env 1", "sim", 0.0, 2.0)
    tl.record("env 1", "sim", 1.0, 3.0)  # overlaps the first: counted once
    tl.record("env 1", "act", 3.0, 4.0)
    tl.record("env 10", "act", 0.0, 4.0)  # a lane with no "sim" counts as 0
    tl.record("generator", "batch", 1.0, 1.5, 8)
    assert tl.busy("env 1", name="sim") == 3.0  # "env 1" is not a prefix of "env 10"
    assert tl.busy("env", name="sim") == 1.5
    assert tl.busy("env") == 4.0
    assert tl.busy("env 1", start=2.5, end=10.0, name="sim") == 0.5
    assert tl.busy_fraction("env 1", 0.0, 4.0) == 1.0
    assert tl.busy_fraction("generator") == pytest.approx(0.5 / 4.0)
    assert tl.busy("learner") == 0.0
    assert tl.lanes() == ["generator", "env 1", "env 10"]


def test_ring_buffer_keeps_the_newest_events():
    tl = Timeline(capacity=3)
    for k in range(5):
        tl.record("learner", "update", float(k), k + 0.5, k)
    assert len(tl) == 3 and tl.full
    assert [e[4] for e in tl.events] == [2, 3, 4]


def test_env_waits_count_what_the_timeline_draws():
    """One observer: the profiler's per-env counters and the timeline's spans come from the same
    calls, so they agree (the barrier is counted apart from the action wait it is drawn in)."""
    import numpy as np

    from ebrl.runtime.driver.loop import EnvWaits

    tl = Timeline()
    w = EnvWaits(2, tl)
    both = np.array([0, 1])
    w.ready(slice(None), 0.0)
    w.submitted(both, 1.0)  # actions after 1 s
    w.stepped(np.array([0]), 2.0)  # env 0 back at 2 s, env 1 at 5 s: a 3 s barrier for env 0
    w.stepped(np.array([1]), 5.0)
    w.passed_barrier(both, 5.0)
    w.parked(both, 5.5)  # a full queue, until 7.5 s
    w.unparked(both, 7.5)
    w.submitted(both, 8.0)
    w.stepped(both, 9.0)
    w.failed(np.array([1]), 9.5)  # drawn, not counted: recovery's time is its own
    c = w.counters(np.zeros(0, np.int64), 9.5)

    def drawn(env, name):
        return sum(t1 - t0 for lane, n, t0, t1, _ in tl.events if lane == f"env {env}" and n == name)

    for env in (0, 1):
        assert c["sim"][env] == pytest.approx(drawn(env, "sim"))
        assert c["action"][env] + c["barrier"][env] == pytest.approx(drawn(env, "act"))
        assert c["backpressure"][env] == pytest.approx(drawn(env, "blocked")) == pytest.approx(2.0)
    assert list(c["barrier"]) == [3.0, 0.0] and list(c["sim"]) == [2.0, 5.0]
    # a park in progress counts up to now
    w.parked(both, 10.0)
    assert list(w.counters(np.array([1]), 11.0)["backpressure"]) == [2.0, 3.0]
