"""What a run needs is checked before it starts: the algorithm's needs (ebrl.algos.needs) fill
the RunConfig's auto fields and refuse contradictions before any env is built, and the policy's
spaces (ebrl.policies.expects) are checked against env 0's before any env steps."""

import asyncio
import multiprocessing

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.envs.registration import EnvSpec

import ebrl
from ebrl.algos import GRPO, PPO, DecoupledPPO, RunNeeds, VTrace, resolve_run_config
from ebrl.config import ConfigError, RunConfig, Schedule, SegmentCut, SimConfig
from ebrl.envs.chunks import ActionChunk
from ebrl.policies import CNNPolicy, FlowPolicy, MLPPolicy, check_policy_spaces
from ebrl.testing import MockEnv, MockPolicy, NoopAlgo, run_virtual

EPISODE = 12  # the time limit TimedEnv declares
STEPPED = multiprocessing.Value("i", 0)  # TimedEnv steps in any process (the probe's forked child included)


class TimedEnv(MockEnv):
    """A MockEnv that declares its time limit, as gym.make's envs do (spec.max_episode_steps)."""

    built: list[int] = []  # env_fn calls in this process, by env index
    total_steps = 0  # steps of every instance in this process (MockEnv.steps counts one instance's)

    def __init__(self, i: int = 0, dim: int = 3):
        TimedEnv.built.append(i)
        super().__init__(dim=dim, episode_len=EPISODE)
        self.spec = EnvSpec("ebrl-test/Timed-v0", max_episode_steps=EPISODE)

    def step(self, action):
        TimedEnv.total_steps += 1
        with STEPPED.get_lock():
            STEPPED.value += 1
        return super().step(action)


@pytest.fixture(autouse=True)
def _fresh_counters():
    TimedEnv.built, TimedEnv.total_steps = [], 0
    STEPPED.value = 0


def ppo_config(**kw) -> RunConfig:
    """A PPO user's config: segments far shorter than the episodes."""
    return RunConfig(num_envs=8, segment_len=4, total_env_steps=2400, sim={"backend": "inline"}, learner="thread",
                     **kw)


def trainer(algo, cfg, policy=None) -> ebrl.Trainer:
    env = TimedEnv()
    policy = policy or MLPPolicy.from_spaces(env.observation_space, env.action_space, hidden=(16, 16), seed=0)
    TimedEnv.built = []
    return ebrl.Trainer(TimedEnv, policy, algo, cfg)


@pytest.mark.parametrize("make_algo", [PPO, DecoupledPPO, VTrace, GRPO], ids=lambda c: c.__name__)
def test_every_algorithm_trains_with_only_algo_changed(make_algo):
    cfg = ppo_config()
    res = ebrl.run_sync(trainer(make_algo(minibatch_size=64), cfg))
    assert res.accounting_ok() and res.env_steps == cfg.total_env_steps and res.updates > 0
    assert cfg.schedule is Schedule.AUTO and cfg.segment_len == 4  # the caller's config is left as it was
    if make_algo is GRPO:  # sync, one episode per segment from reset groups, segments raised to the time limit
        assert res.schedule == "sync"
        assert all(h["segments_used"] > 0 for h in res.history), [h["segments_used"] for h in res.history]
        assert all(h["segments_incomplete"] == 0 for h in res.history)  # no episode was cut short
    else:
        assert res.schedule == "async"
        assert all(np.isfinite(h["policy_loss"]) for h in res.history)


@pytest.mark.parametrize("algo, setting, field", [
    (GRPO(), {"segment_cut": "length"}, "segment_cut"),
    (GRPO(), {"reset_group": 1}, "reset_group"),
    (GRPO(min_group=4), {"reset_group": 2}, "reset_group"),
    (GRPO(), {"num_envs": 8, "sim": {"vector_size": 2}}, "sim.vector_size"),
])
def test_a_contradiction_raises_naming_the_field_before_any_env_is_built(algo, setting, field):
    cfg = RunConfig(**{**{"num_envs": 8, "total_env_steps": 800}, **setting})  # sim backend: auto (the probe)
    tr = ebrl.Trainer(TimedEnv, MockPolicy(act_dim=3), algo, cfg)
    with pytest.raises(ConfigError) as err:
        ebrl.run_sync(tr)
    assert err.value.field == field and "GRPO needs" in str(err.value)
    assert TimedEnv.built == []  # not even env 0 for the inspection


def test_an_explicit_async_schedule_stays_and_ppo_may_cut_at_episodes():
    grpo = resolve_run_config(RunConfig(num_envs=8, schedule="async"), GRPO())
    assert (grpo.schedule, grpo.segment_cut, grpo.reset_group) == ("async", "episode", 4)
    ppo = resolve_run_config(RunConfig(num_envs=8, segment_cut="episode", reset_group=2), PPO())
    assert (ppo.schedule, ppo.segment_cut, ppo.reset_group) == ("async", "episode", 2)


@pytest.mark.parametrize("policy, env_fn, says", [
    (MLPPolicy(8, act_dim=4), lambda i: TimedEnv(i, dim=8), ["acts in a Box of shape (4,)", "(8,)"]),
    (MLPPolicy(4, discrete_actions=4), lambda i: TimedEnv(i, dim=4), ["acts in Discrete(4)", "Box(-1.0, 1.0, (4,)"]),
    (MLPPolicy(3, 4), lambda i: TimedEnv(i, dim=4), ["reads a Box observation of 3 elements", "(4,)"]),
    (FlowPolicy(3, (3,), -1.0, 1.0, hidden=(8,), critic_hidden=(8,)), lambda i: ActionChunk(TimedEnv(i), k=2),
     ["acts in a Box of shape (3,)", "(2, 3)"]),
    (MockPolicy(act_dim=2), lambda i: TimedEnv(i), ["acts in a Box of shape (2,)", "(3,)"]),
], ids=["act_dim", "discrete-vs-box", "obs-shape", "chunks", "mock"])
@pytest.mark.parametrize("backend", ["thread", "auto"])
def test_a_policy_built_for_other_spaces_fails_before_any_env_steps(policy, env_fn, says, backend):
    # start_method fork: the probe is a child also where this pytest process rendered before
    cfg = RunConfig(num_envs=4, segment_len=8, total_env_steps=400, sim={"backend": backend, "start_method": "fork"},
                    learner="process")
    with pytest.raises(ConfigError) as err:
        ebrl.run_sync(ebrl.Trainer(env_fn, policy, PPO(), cfg))
    assert err.value.field == "policy" and all(s in str(err.value) for s in says), str(err.value)
    # env 0 was built once to read its spaces (thread: here; auto: in the probe's child); no env
    # stepped anywhere, the AUTO probe's timing steps included (the check comes between its
    # reset and its steps)
    assert TimedEnv.built == ([0] if backend == "thread" else []) and STEPPED.value == 0


def test_virtual_time_checks_inline_before_any_step():
    with pytest.raises(ConfigError, match="acts in a Box of shape .4,."):
        run_virtual(ebrl.Trainer(TimedEnv, MockPolicy(act_dim=4), NoopAlgo(), RunConfig(num_envs=2)))
    assert TimedEnv.built == [0] and TimedEnv.total_steps == 0
    res = run_virtual(ebrl.Trainer(TimedEnv, MockPolicy(act_dim=3), NoopAlgo(),
                                   RunConfig(num_envs=2, segment_len=4, total_env_steps=80)))
    assert res.env_steps == 80 and res.schedule == "async"


def test_check_policy_spaces_compares_dtypes_dicts_and_skips_undeclared_policies():
    pixels = lambda dtype: gym.spaces.Dict({"pixels": gym.spaces.Box(0, 255, (16, 16, 3), dtype),  # noqa: E731
                                            "state": gym.spaces.Box(-1, 1, (2,), np.float32)})
    act = gym.spaces.Discrete(3)
    cnn = CNNPolicy.from_spaces(pixels(np.uint8), act, feature_dim=8, hidden=(8,))
    check_policy_spaces(cnn, pixels(np.uint8), act)
    with pytest.raises(ConfigError, match=r"reads Dict entries \['pixels'\] of shape \(16, 16, 3\), uint8, but"):
        check_policy_spaces(cnn, pixels(np.float32), act)
    with pytest.raises(ConfigError, match=r"reads Dict entries \['pixels'\].*; acts in Discrete\(3\)"):
        check_policy_spaces(cnn, gym.spaces.Box(-1, 1, (4,)), gym.spaces.Discrete(2))  # both wrong: one error
    check_policy_spaces(MLPPolicy(12, 2), gym.spaces.Box(-1, 1, (3, 4)), gym.spaces.Box(-1, 1, (2,)))  # flattened
    check_policy_spaces(object(), gym.spaces.Box(-1, 1, (3,)), act)  # declares nothing: not checked


def test_resolve_fills_auto_from_the_algorithms_needs():
    plain = resolve_run_config(RunConfig(num_envs=8), NoopAlgo(), time_limit=50)  # declares nothing
    assert (plain.schedule, plain.segment_cut, plain.reset_group, plain.segment_len) == ("async", "length", None, 64)
    grpo = resolve_run_config(RunConfig(num_envs=8, segment_len=30), GRPO(), time_limit=50)
    assert (grpo.schedule, grpo.segment_cut, grpo.reset_group, grpo.segment_len) == ("sync", "episode", 4, 50)
    assert resolve_run_config(grpo, GRPO(), time_limit=50) == grpo  # resolving again changes nothing
    assert resolve_run_config(RunConfig(num_envs=6), GRPO()).reset_group == 3  # 4 does not divide 6
    assert resolve_run_config(RunConfig(num_envs=10), GRPO(min_group=5)).reset_group == 5
    assert resolve_run_config(RunConfig(num_envs=8, segment_len=80), GRPO(), time_limit=50).segment_len == 80
    with pytest.raises(ConfigError, match="num_envs=1: GRPO needs reset groups of at least 2 envs"):
        resolve_run_config(RunConfig(num_envs=1), GRPO())

    class Mine:  # a user's algorithm with needs of its own
        run_needs = RunNeeds(segment_cut=SegmentCut.EPISODE, schedule=Schedule.PIPELINED)

        def update(self, policy, batch):
            return {}

    mine = resolve_run_config(RunConfig(num_envs=4), Mine())
    assert (mine.schedule, mine.segment_cut, mine.reset_group) == ("pipelined", "episode", None)

    class Wrong(Mine):
        run_needs = {"segment_cut": "episode"}

    with pytest.raises(ConfigError, match="run_needs must be an ebrl.algos.RunNeeds"):
        resolve_run_config(RunConfig(), Wrong())


def test_probe_carries_env_0s_facts_on_every_backend():
    from ebrl.config import FaultConfig
    from ebrl.runtime.probe import EnvProbe

    async def probe(backend):
        async with EnvProbe(TimedEnv, SimConfig(backend=backend, start_method="fork"), FaultConfig()) as p:
            return await p.facts(), await p.step_profile()

    for backend in ("auto", "thread"):
        facts, step = asyncio.run(probe(backend))
        assert (step is not None) == (backend == "auto")  # only AUTO measures a step
        assert facts.max_episode_steps == EPISODE and facts.action_space.shape == (3,)
    assert TimedEnv.built == [0]  # thread: built here, once; auto: in the probe's child


def test_the_cli_runs_grpo_with_what_it_needs_and_refuses_a_contradiction(tmp_path, capsys):
    from ebrl.cli import main
    from ebrl.runs import build_spec, build_trainer

    tr = build_trainer(build_spec(None, ["env=mock/3", "run.num_envs=8", "algo.kind=grpo"]))
    assert (tr.config.schedule, tr.config.segment_cut, tr.config.reset_group) == ("sync", "episode", 4)
    code = main(["train", "--quiet", "--log-dir", str(tmp_path), "--set", "env=mock/3", "--set", "algo.kind=grpo",
                 "--set", "run.segment_cut=length"])
    assert code == 2 and "segment_cut='length': GRPO needs 'episode'" in capsys.readouterr().err
