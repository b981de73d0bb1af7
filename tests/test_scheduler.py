"""Scheduler properties on virtual time: exact, deterministic, fast."""

import pytest

import ebrl
from ebrl.testing import Latency, MockEnv, MockPolicy, NoopAlgo, run_virtual


def trainer(schedule="async", num_envs=8, total=4000, slow=None, lag=1, T=16, policy=None, algo=None,
            latency=Latency.constant(0.001), **cfg):
    def env_fn(i):
        lat = Latency.constant(latency.a * 10) if i == slow else latency
        return MockEnv(latency=lat)

    return ebrl.Trainer(env_fn=env_fn, policy=policy or MockPolicy(act_dim=4),
                        algo=algo or NoopAlgo(base_cost_s=0.002),
                        config=ebrl.RunConfig(num_envs=num_envs, segment_len=T, total_env_steps=total,
                                              schedule=schedule, max_policy_lag=lag, **cfg))


def test_no_barrier_async_fast_envs_run_ahead_of_slow_one():
    res = run_virtual(trainer("async", slow=0, sim={"num_threads": 8}))
    fast = res.steps_per_env[1:]
    assert res.accounting_ok()
    # the slow env takes 10x per step; the others are not held to its pace
    assert min(fast) >= 5 * res.steps_per_env[0]


def test_no_barrier_sync_holds_everyone_to_the_slow_env():
    res = run_virtual(trainer("sync", slow=0, sim={"num_threads": 8}))
    assert len(set(res.steps_per_env)) == 1
    assert res.accounting_ok()


def test_async_beats_sync_and_pipelined_in_virtual_time_on_long_tail():
    kw = dict(num_envs=16, total=8000, latency=Latency.lognormal(0.002, 1.0), sim={"num_threads": 16})
    t = {s: run_virtual(trainer(s, **kw)).wall_s for s in ("async", "pipelined", "sync")}
    assert t["async"] < t["pipelined"] <= t["sync"] * 1.05
    assert t["sync"] / t["async"] > 1.5


def test_generation_batches_many_waiting_envs_and_bounds_the_wait():
    policy = MockPolicy(act_dim=4, base_cost_s=0.0005, per_item_cost_s=1e-5)
    res = run_virtual(trainer("async", num_envs=32, total=6000, policy=policy,
                              latency=Latency.uniform(0.0005, 0.004), sim={"num_threads": 32},
                              generation={"batch_target": 8, "max_wait_s": 0.001}))
    assert res.gen_batch_mean > 1 and max(res.gen_batch_hist) >= 8
    # a request waits at most max_wait_s for its batch, plus one batch already running
    worst_batch_cost = policy.virtual_cost(32)
    assert res.gen_wait_max_s <= 0.001 + worst_batch_cost + 1e-9


def test_generation_waits_for_everyone_when_all_live_envs_are_waiting():
    """Rule 2 of the generator: a batch runs as soon as every *live* env waits, before any timeout.

    Async schedule, ``batch_target`` (100) far above the 4 envs, ``max_wait_s`` 1 s, so only
    "everyone live is waiting" can start a batch early. The envs step in 1, 1.5, 2 and 2.5 ms
    (one lane each), so their requests arrive spread over 1.5 ms; the policy costs 10 ms a
    batch, so the adaptive wait (~one batch) exceeds that spread and the batch waits for the
    slowest env instead of timing out on a partial batch. The budget (402 = 4 * 100 + 2) makes
    two envs stop before the last round: the live count drops to 2 and so must the last batch.

    It fails if rule 2 is broken or ignores the live count: a generator that runs a batch only
    on ``batch_target`` or a timeout waits ~10 ms (the adaptive wait) per round, or ~1 s
    (``max_wait_s``), and one that counts stopped envs as live waits ~10 ms on the last batch;
    both show in the virtual wall time (exact here) and in the longest request wait. A
    generator that did not wait at all would make batches of 1.
    """
    lat, cost, algo_cost, total = [0.001, 0.0015, 0.002, 0.0025], 0.010, 0.002, 402
    n = len(lat)
    policy = MockPolicy(act_dim=4, base_cost_s=cost)
    res = run_virtual(ebrl.Trainer(
        lambda i: MockEnv(latency=Latency.constant(lat[i])), policy, NoopAlgo(base_cost_s=algo_cost),
        ebrl.RunConfig(num_envs=n, segment_len=16, total_env_steps=total, schedule="async", sim={"num_threads": n},
                       generation={"batch_target": 100, "max_wait_s": 1.0})))
    rounds, rest = divmod(total, n)
    assert res.env_steps == total and res.accounting_ok()
    assert res.steps_per_env == [rounds + 1] * rest + [rounds] * (n - rest)
    # every batch holds every live env: all 4, then the 2 left once the budget ran out
    assert res.gen_batch_hist == {n: rounds, rest: 1}
    # a request waits only for the slower live envs to arrive, never for a timeout
    assert res.gen_wait_max_s <= max(lat) - min(lat) + 1e-9
    # each round is one batch plus the slowest env's step; then the last, smaller round and the final update
    expected = rounds * (cost + max(lat)) + cost + max(lat[:rest]) + algo_cost
    assert rounds * (cost + max(lat)) <= res.wall_s <= expected + 0.001  # a missed rule costs >= ~8 ms


@pytest.mark.parametrize("gen_cost", [0.0, 0.003])
@pytest.mark.parametrize("lag", [0, 1, 2])
@pytest.mark.parametrize("schedule", ["async", "pipelined"])
def test_every_trained_sample_is_within_max_policy_lag(lag, schedule, gen_cost):
    algo = NoopAlgo(base_cost_s=0.2)  # training slower than rollout: the lag bound is under pressure
    policy = MockPolicy(act_dim=4, base_cost_s=gen_cost)  # a policy call takes time: cuts land mid-batch
    res = run_virtual(trainer(schedule, slow=3, lag=lag, algo=algo, policy=policy, total=6000,
                              latency=Latency.lognormal(0.001, 1.0), sim={"num_threads": 8}))
    lags = [int(x) for b in algo.batches for x in b.lags.tolist()]
    assert len(lags) == res.trained == sum(b.num_steps for b in algo.batches)
    assert max(lags) <= (lag if schedule == "async" else 0)
    assert res.lag_max == max(lags)
    if schedule == "async" and lag > 0:
        assert max(lags) == lag  # the bound is used, not just respected by never overlapping


def test_accounting_with_faults_nan_drops_and_a_stop():
    import asyncio

    made = {}

    def env_fn(i):
        made[i] = made.get(i, 0) + 1
        first = made[i] == 1
        return MockEnv(latency=Latency.uniform(0.001, 0.003),
                       fail_at_step=37 if (i == 2 and first) else None,
                       nan_at_step=50 if (i == 5 and first) else None)

    cfg = ebrl.RunConfig(num_envs=8, segment_len=16, total_env_steps=100_000, faults={"nonfinite": "drop"})
    tr = ebrl.Trainer(env_fn, MockPolicy(act_dim=4), NoopAlgo(base_cost_s=0.003), cfg)

    async def main():
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.5, stop.set)
        return await ebrl.run(tr, stop=stop, platform=virtual_platform())

    from ebrl.testing import VirtualTimeLoop, virtual_platform

    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        res = runner.run(main())
    assert res.env_steps < 100_000  # stopped early
    assert res.env_failures == 1 and made[2] == 2
    assert res.dropped["env_error"] > 0 and res.dropped["nonfinite"] >= 1
    assert res.in_flight_at_stop > 0
    assert res.env_steps == res.trained + sum(res.dropped.values()) + res.in_flight_at_stop


def test_env_that_raises_is_rebuilt_and_run_completes():
    made = []

    def env_fn(i):
        made.append(i)
        return MockEnv(fail_at_step=5 if (i == 1 and made.count(1) == 1) else None, latency=Latency.constant(0.001))

    res = run_virtual(ebrl.Trainer(env_fn, MockPolicy(act_dim=4), NoopAlgo(),
                                   ebrl.RunConfig(num_envs=4, segment_len=8, total_env_steps=800)))
    assert made.count(1) == 2 and res.env_failures == 1
    assert res.dropped == {"env_error": 4}  # steps 1-4 of env 1's open segment; step 5 never completed
    assert res.env_steps == 800 and res.accounting_ok()


def test_too_many_failures_stop_the_run_with_a_clear_error():
    from ebrl.runtime.errors import TooManyEnvFailures

    tr = ebrl.Trainer(lambda i: MockEnv(fail_at_step=3), MockPolicy(act_dim=4), NoopAlgo(),
                      ebrl.RunConfig(num_envs=2, total_env_steps=1000, faults={"max_env_failures": 3},
                                     sim={"backend": "thread"}))  # AUTO's probe would step env 0 into its fault
    with pytest.raises(TooManyEnvFailures, match="max_env_failures=3"):
        run_virtual(tr)


def test_nonfinite_raises_by_default_naming_env_and_step():
    from ebrl.runtime.errors import NonFiniteError

    tr = ebrl.Trainer(lambda i: MockEnv(nan_at_step=7 if i == 1 else None), MockPolicy(act_dim=4), NoopAlgo(),
                      ebrl.RunConfig(num_envs=2, total_env_steps=1000))
    with pytest.raises(NonFiniteError, match="env 1 .*step 6"):
        run_virtual(tr)


def test_sync_rounds_down_to_whole_lockstep_steps_and_is_deterministic():
    a = run_virtual(trainer("sync", num_envs=8, total=1000, latency=Latency.lognormal(0.001, 0.5)))
    b = run_virtual(trainer("sync", num_envs=8, total=1000, latency=Latency.lognormal(0.001, 0.5)))
    assert a.env_steps == 1000 // 8 * 8
    assert a.wall_s == b.wall_s and a.history == b.history


@pytest.mark.parametrize("schedule", ["async", "pipelined", "sync"])
def test_learner_wakes_on_events_not_on_every_env_step(schedule):
    """The rollout queue wakes the learner when a segment closes, a driver blocks or ends, the
    run finishes, or a stale in-flight step clears: far fewer times than env steps (it used to
    wake once per recorded step), and never fewer than once per update."""
    T = 16
    res = run_virtual(trainer(schedule, num_envs=8, total=4000, T=T, sim={"num_threads": 8},
                              latency=Latency.lognormal(0.001, 0.5)))
    assert res.accounting_ok() and res.updates > 0
    assert res.updates <= res.learner_wakeups <= res.env_steps / T + res.updates * (8 + 1) + 8 + 1
    assert res.learner_wakeups < res.env_steps / 4


class StreamingAlgo(NoopAlgo):
    """An off-policy stand-in: it can train on a stream (RunNeeds(stream=True), as SAC)."""

    from ebrl.algos import RunNeeds

    run_needs = RunNeeds(stream=True)


@pytest.mark.parametrize("train_cost", [0.0005, 0.05])
def test_a_stream_hands_steps_over_before_their_segments_fill(train_cost):
    """Under segment_cut='auto' an algorithm that streams gets every step recorded since its last
    update, at least one per env's worth, whether the learner keeps up (cheap updates: about one
    step per env each) or not (slow ones: whatever arrived meanwhile, over the lag bound, never
    waiting for steps in flight); every step is trained once."""
    algo = StreamingAlgo(base_cost_s=train_cost)
    res = run_virtual(trainer("async", num_envs=8, total=2000, T=64, algo=algo, lag=1,
                              latency=Latency.lognormal(0.001, 1.0), sim={"num_threads": 8}))
    sizes = [b.num_steps for b in algo.batches]
    assert res.accounting_ok() and sum(sizes) == res.trained == res.env_steps == 2000
    assert all(n >= 8 for n in sizes[:-1])  # the last one is the rest at the end
    assert max(b.mask.shape[1] for b in algo.batches) < 64  # no update waited for a segment to fill
    if train_cost < 0.001:
        assert sorted(sizes)[len(sizes) // 2] == 8  # the learner keeps up: a step per env, typically
    else:
        assert sorted(sizes)[len(sizes) // 2] > 64  # what arrived during a 50 ms update
    assert res.lag_max > 1  # no lag bound: steps in flight were not awaited


def test_a_stream_is_for_algorithms_that_declare_it_and_only_under_async():
    from ebrl.algos import PPO, SAC, resolve_run_config
    from ebrl.config import ConfigError, RunConfig

    assert resolve_run_config(RunConfig(num_envs=4), SAC()).segment_cut == "stream"
    for cfg in (RunConfig(num_envs=4, schedule="sync"), RunConfig(num_envs=4, max_policy_lag=0)):
        assert resolve_run_config(cfg, SAC()).segment_cut == "length"  # lockstep or lag 0: whole segments
    assert resolve_run_config(RunConfig(num_envs=4), PPO()).segment_cut == "length"
    with pytest.raises(ConfigError, match="segment_cut='stream': PPO trains on segments whose policy lag"):
        resolve_run_config(RunConfig(num_envs=4, segment_cut="stream"), PPO())
    with pytest.raises(ConfigError, match="segment_cut='stream': needs schedule='async' and max_policy_lag > 0"):
        resolve_run_config(RunConfig(num_envs=4, segment_cut="stream", schedule="pipelined"), SAC())
