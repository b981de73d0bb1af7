"""Resets as stragglers (LIBERO rebuilds its scene at every reset: seconds, against
milliseconds a step). Per-env async lets the other envs step through one env's reset; the
lockstep schedules make them wait for it. Asserted on step counters, in virtual time: the
counts are the schedule's, not the machine's."""

import pytest

import ebrl
from ebrl.testing import Latency, MockEnv, MockPolicy, NoopAlgo, run_virtual


class ResetsInItsStep(MockEnv):
    """A MockEnv whose autoreset (run inside the step that ends an episode) costs its
    ``reset_latency`` there in virtual time too, where MockEnv sleeps nothing: that step declares
    the reset's cost with its own."""

    def step(self, action):
        out = super().step(action)
        if out[2] or out[3]:
            self.virtual_step_cost += self.reset_latency.sample(self._lat_rng)
        return out


def trainer(schedule: str) -> ebrl.Trainer:
    def env_fn(i: int) -> MockEnv:
        if i == 0:  # short episodes and slow resets: env 0 spends most of its time resetting
            return ResetsInItsStep(episode_len=4, latency=Latency.constant(0.001), reset_latency=Latency.constant(0.1))
        return MockEnv(episode_len=10_000, latency=Latency.constant(0.001))

    return ebrl.Trainer(env_fn, MockPolicy(act_dim=4), NoopAlgo(), ebrl.RunConfig(
        num_envs=4, segment_len=8, total_env_steps=480, schedule=schedule, seed=0,
        sim={"backend": "thread", "num_threads": 4}))


@pytest.mark.parametrize("schedule", ["async", "sync"])
def test_a_resetting_env_holds_back_only_itself_under_async(schedule, no_leaks):
    res = run_virtual(trainer(schedule))
    assert res.env_steps == 480 and res.accounting_ok()
    resetting, others = res.steps_per_env[0], res.steps_per_env[1:]
    if schedule == "async":
        # each of env 0's resets lets the others take about 100 steps of their own
        assert min(others) > 3 * resetting, res.steps_per_env
    else:  # lockstep: every env waits for env 0's resets, so all step alike
        assert max(res.steps_per_env) - min(res.steps_per_env) <= 8, res.steps_per_env
