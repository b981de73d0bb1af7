"""The simulators of the [sims] extra, through the registry and the runtime."""

import math
import sys

import numpy as np
import pytest

import ebrl
from ebrl.envs import list_envs, make
from ebrl.testing import MockPolicy, NoopAlgo

CASES = ["mujoco/Hopper-v5", "robotics/FetchReachDense-v4", "robotics/FetchPush-v4",
         "robotics/HandManipulateBlock-v1", "robotics/AdroitHandDoor-v1", "robotics/FrankaKitchen-v1",
         "dmc/cartpole-swingup", "dmc/walker-walk"]


def test_list_envs_names_every_installed_suite():
    names = set(list_envs())
    assert {"mujoco/HalfCheetah-v5", "robotics/FetchReachDense-v4", "dmc/cartpole-swingup"} <= names
    assert all(n.startswith("dmc/") for n in list_envs("dmc"))


@pytest.mark.parametrize("name", CASES)
def test_env_steps_under_the_async_runtime(name):
    probe = make(name)
    obs_shape, act = probe.observation_space.shape, probe.action_space
    probe.close()
    assert obs_shape is not None and len(obs_shape) == 1  # flattened to one vector
    cfg = ebrl.RunConfig(num_envs=2, segment_len=25, total_env_steps=300, sim={"backend": "thread"})
    algo = NoopAlgo()
    res = ebrl.run_sync(ebrl.Trainer(lambda i: make(name), MockPolicy(act_dim=act.shape[0], random=True), algo, cfg))
    assert res.env_steps == 300 and res.trained == 300 and res.accounting_ok()
    batch = algo.batches[0]
    assert tuple(batch.obs.shape[2:]) == obs_shape and tuple(batch.actions.shape[2:]) == act.shape
    if name.startswith("robotics/Fetch"):  # 50-step episodes that report is_success
        assert res.episodes >= 4 and not math.isnan(res.success_once) and not math.isnan(res.success_at_end)


@pytest.mark.parametrize("name", ["dmc/cartpole-swingup", "robotics/FetchReachDense-v4", "mujoco/Hopper-v5"])
def test_seeded_resets_are_reproducible(name):
    a, b = make(name), make(name)
    oa, _ = a.reset(seed=7)
    ob, _ = b.reset(seed=7)
    np.testing.assert_array_equal(oa, ob)
    oc, _ = a.reset(seed=8)
    assert not np.array_equal(oa, oc)


def test_dmc_time_limit_is_truncation_not_termination():
    env = make("dmc/cartpole-swingup")
    env.reset(seed=0)
    steps, done = 0, False
    while not done:
        _, reward, terminated, truncated, _ = env.step(np.zeros(1, np.float32))
        steps += 1
        done = terminated or truncated
        assert np.isfinite(reward)
    assert steps == 1000 and truncated and not terminated


def test_success_once_and_at_end_are_counted_per_episode():
    from ebrl.runtime.stats import RunStats

    st = RunStats()
    st.episode(1.0, 10, True, False)  # succeeded mid-episode, then lost it
    st.episode(1.0, 10, True, True)
    st.episode(1.0, 10, None, None)  # an env without a success signal does not dilute the rate
    assert list(st.success_once) == [1.0, 1.0] and list(st.success_at_end) == [0.0, 1.0]


def test_every_episode_is_logged_with_its_env_and_aggregated(tmp_path):
    import json

    from ebrl.telemetry import configure_logging
    from ebrl.testing import MockEnv, MockPolicy, NoopAlgo, run_virtual

    cfg = ebrl.RunConfig(num_envs=3, segment_len=8, total_env_steps=300)
    configure_logging("info", json_path=tmp_path / "events.jsonl", console=False)
    try:
        res = run_virtual(ebrl.Trainer(lambda i: MockEnv(episode_len=10 + i), MockPolicy(act_dim=4), NoopAlgo(), cfg))
    finally:
        configure_logging("warning", console=False)
    logs = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    episodes = [e for e in logs if e["event"] == "episode"]
    assert len(episodes) == res.episodes > 0
    for env_id in range(3):
        mine = [e for e in episodes if e["env"] == env_id]
        assert mine and all(e["length"] == 10 + env_id and e["truncated"] for e in mine)
        assert len(mine) == res.steps_per_env[env_id] // (10 + env_id)
    assert sum(e["ep_return"] for e in episodes) == pytest.approx(res.mean_return * res.episodes)


@pytest.mark.parametrize("module, name", [("gymnasium_robotics", "robotics/FetchReach-v4"),
                                          ("dm_control", "dmc/cartpole-swingup")])
def test_missing_simulator_says_what_to_install(monkeypatch, module, name):
    monkeypatch.setitem(sys.modules, module, None)  # import now fails, as when it is not installed
    with pytest.raises(ImportError, match=r"pip install 'ebrl\[sims\]'"):
        make(name)


def test_unknown_names_suggest_close_matches():
    with pytest.raises(ValueError, match="did you mean FetchReach-v4"):
        make("robotics/FetchRech-v4")
    with pytest.raises(ValueError, match="did you mean cartpole-swingup"):
        make("dmc/cartpole-swingp")


def test_action_chunks_step_exactly_and_stop_at_episode_end():
    from ebrl.envs.chunks import ActionChunk
    from ebrl.testing import MockEnv

    inner = MockEnv(dim=2, episode_len=10)
    env = ActionChunk(inner, k=4)
    env.reset(seed=0)
    taken, ends = [], 0
    for _ in range(6):
        _, reward, terminated, truncated, info = env.step(np.zeros((4, 2), np.float32))
        taken.append(info["chunk_steps"])
        assert reward == pytest.approx(info["chunk_rewards"].sum())
        if terminated or truncated:
            ends += 1
            env.reset()
    assert taken[:3] == [4, 4, 2] and ends == 2  # 10-step episodes: 4 + 4 + 2
    assert sum(taken) == inner.steps  # every primitive step counted once
    with pytest.raises(ValueError, match="expected 4 actions"):
        env.step(np.zeros((3, 2), np.float32))


class FakeMetaWorldEnv(__import__("gymnasium").Env):
    """Stands in for Meta-World's MT1 env (its mujoco pin keeps it out of this environment)."""

    def __init__(self, env_name, seed=None):
        import gymnasium as gym

        self.env_name, self.t = env_name, 0
        self.observation_space = gym.spaces.Box(-1, 1, (39,), np.float32)
        self.action_space = gym.spaces.Box(-1, 1, (4,), np.float32)

    def reset(self, *, seed=None, options=None):
        self.t = 0
        return np.zeros(39, np.float32), {}

    def step(self, action):
        self.t += 1
        return np.zeros(39, np.float32), 0.0, False, self.t >= 10, {"success": float(self.t in (3, 4))}


def test_metaworld_adapter_builds_mt1_and_its_success_reaches_the_stats(monkeypatch):
    import types

    import gymnasium as gym

    monkeypatch.setitem(sys.modules, "metaworld", types.ModuleType("metaworld"))
    gym.register("Meta-World/MT1", entry_point=FakeMetaWorldEnv)
    try:
        env = make("metaworld/reach-v3", seed=3)
        assert env.unwrapped.env_name == "reach-v3"
        res = ebrl.run_sync(ebrl.Trainer(lambda i: make("metaworld/reach-v3"), MockPolicy(act_dim=4), NoopAlgo(),
                                         ebrl.RunConfig(num_envs=2, segment_len=10, total_env_steps=40,
                                                        sim={"backend": "inline"})))
        assert res.episodes == 4 and res.success_once == 1.0 and res.success_at_end == 0.0
    finally:
        gym.registry.pop("Meta-World/MT1", None)


def test_metaworld_missing_says_it_needs_its_own_environment(monkeypatch):
    monkeypatch.setitem(sys.modules, "metaworld", None)
    with pytest.raises(ImportError, match=r"mujoco 3.3.0.*ebrl\[metaworld\]"):
        make("metaworld/reach-v3")
