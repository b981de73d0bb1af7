"""gymnasium conformance: ``gymnasium.utils.env_checker.check_env`` over one env of every
registry family, as ``ebrl.envs.make`` returns it, with its warnings turned into errors.

check_env checks the spaces, reset/step return types, seeded determinism of reset and step,
that no two calls return shared arrays, and, for an env with a spec, that ``env.spec.make()``
recreates it (which needs every wrapper to record its constructor arguments). Families that
cannot run here (Meta-World) run on the fakes of their own test modules; LIBERO is checked
for real in tests/test_libero.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env, data_equivalence
from gymnasium.utils.passive_env_checker import data_shares_objects

from ebrl.envs import make
from ebrl.envs.chunks import ActionChunk
from tests import test_maniskill, test_so101
from tests.test_maniskill import TASK as MANISKILL_TASK
from tests.test_maniskill import FakeManiSkillEnv, fake_maniskill  # noqa: F401  (fake_maniskill: a fixture)
from tests.test_sims import FakeMetaWorldEnv

# Warnings that are not our code's, allowed by name where a family raises them:
# check_env's advice to check `env.unwrapped`, given for every wrapped env (gymnasium.make's own
# TimeLimit/OrderEnforcing/PassiveEnvChecker included): we check the envs as make() returns them.
WRAPPED = r".*is different from the unwrapped version"
# Box bounds of -inf/inf: the simulators publish no bounds for these observations (gymnasium's
# MuJoCo envs and gymnasium-robotics declare Box(-inf, inf); dm_control's observation specs are
# unbounded ArraySpecs; robosuite's end-effector proprio has no limits).
UNBOUNDED = r".*A Box observation space m(in|ax)imum value is -?infinity"


@dataclass
class Case:
    build: Callable[[], gym.Env]
    allowed: tuple[str, ...] = ()  # warning patterns that come from upstream, see above
    # check_env's render check remakes the env in every render mode its metadata lists: for
    # gymnasium's MuJoCo envs that includes "human", which needs a display (GLFW aborts the
    # process without one). render() is not what these tests are about, so those skip it.
    render_check: bool = False
    recreatable: bool = True  # has a spec: env.spec.make() must rebuild the same env


CASES = {
    "mujoco": Case(lambda: make("mujoco/HalfCheetah-v5"), (WRAPPED, UNBOUNDED)),
    "mujoco-pixels": Case(lambda: make("mujoco/HalfCheetah-v5", pixels=84, frame_stack=2), (WRAPPED, UNBOUNDED),
                          render_check=True),
    "robotics-fetch": Case(lambda: make("robotics/FetchReachDense-v4"), (WRAPPED, UNBOUNDED)),
    "robotics-fetch-pixels": Case(lambda: make("robotics/FetchReachDense-v4", pixels=84), (WRAPPED, UNBOUNDED),
                                  render_check=True),
    "robotics-adroit": Case(lambda: make("robotics/AdroitHandDoor-v1"), (WRAPPED, UNBOUNDED)),
    "dmc": Case(lambda: make("dmc/cartpole-swingup"), (UNBOUNDED,), render_check=True),
    "dmc-pixels": Case(lambda: make("dmc/cartpole-swingup", pixels=84), (UNBOUNDED,), render_check=True),
    # MockEnv has no spec (make() builds it directly), so check_env compares no reset
    # observations: _assert_seeded_resets_repeat does; the render check would only warn that
    # a spec-less env's render modes cannot be tried.
    "mock": Case(lambda: make("mock/4"), recreatable=False),
    "chunks": Case(lambda: ActionChunk(make("mujoco/HalfCheetah-v5"), 4), (WRAPPED, UNBOUNDED)),
    # the real simulators (each skips, saying why, where it is not installed or has no Vulkan driver);
    # ManiSkill's CPU backend calls np.isnan on a torch tensor in every step, which NumPy 2 deprecates
    "maniskill-cpu": Case(lambda: test_maniskill.real_env(), (WRAPPED, UNBOUNDED, test_maniskill.ARRAY_WRAP)),
    "so101": Case(lambda: test_so101.so101_env(), (WRAPPED, UNBOUNDED)),
}


def _check(env: gym.Env, allowed=(), render_check: bool = False) -> None:
    """check_env with every warning an error, except the ``allowed`` upstream ones."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for pattern in allowed:
            warnings.filterwarnings("ignore", message=pattern)
        check_env(env, skip_render_check=not render_check)
        _assert_seeded_resets_repeat(env)


def _assert_seeded_resets_repeat(env: gym.Env) -> None:
    # check_env compares the observations of two reset(seed=123) only for an env with a spec
    first, _ = env.reset(seed=123)
    again, _ = env.reset(seed=123)
    assert data_equivalence(first, again, exact=True) and not data_shares_objects(first, again)


def _assert_recreates(env: gym.Env) -> None:
    assert env.spec is not None, f"{env} has no spec: it cannot be recreated"
    twin = env.spec.make()
    try:
        assert str(twin) == str(env)  # the same wrappers, in the same order
        assert twin.observation_space == env.observation_space and twin.action_space == env.action_space
    finally:
        twin.close()


@pytest.mark.parametrize("name", list(CASES))
def test_every_family_passes_gymnasiums_env_checker(name):
    case = CASES[name]
    env = case.build()
    try:
        _check(env, case.allowed, case.render_check)
        if case.recreatable:
            _assert_recreates(env)
    finally:
        env.close()  # a GL context freed at interpreter exit prints EGL errors


def test_pixel_envs_record_their_wrapper_arguments():
    env = make("mujoco/HalfCheetah-v5", pixels=84, frame_stack=2, keep_state=False, fast_render=True)
    try:
        (wrapper,) = env.spec.additional_wrappers
        assert wrapper.name == "PixelObservation"
        assert wrapper.kwargs == {"frame_stack": 2, "keep_state": False, "fast_render": True}
        assert env.spec.kwargs["render_mode"] == "rgb_array" and env.spec.kwargs["width"] == 84
        assert env.metadata["render_modes"] == ["rgb_array"]  # the only mode that gives pixels
        _assert_recreates(env)
    finally:
        env.close()


def test_dmc_renders_headless_after_a_state_only_env_came_first():
    # dm_control chooses its OpenGL backend when it is first imported; a state-only env made
    # first, with MUJOCO_GL unset, used to leave the process with GLFW (no display here)
    code = textwrap.dedent("""
        import warnings
        from gymnasium.utils.env_checker import check_env
        from ebrl.envs import make
        make("dmc/cartpole-swingup").close()
        env = make("dmc/cartpole-swingup", pixels=16)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            warnings.filterwarnings("ignore", message=r".*infinity")  # dm_control's unbounded specs
            check_env(env)
        env.close()
    """)
    environ = {k: v for k, v in os.environ.items() if k not in ("MUJOCO_GL", "PYOPENGL_PLATFORM")}
    # no -W error here: GLFW's "DISPLAY is missing" warning would then fail dm_control's GLFW
    # import and make it fall back to EGL by itself, hiding the bug
    out = subprocess.run([sys.executable, "-c", code], env=environ,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]


# ---- families that cannot run here, on the fakes of their own tests ---------------------------


class SeededFakeMetaWorldEnv(FakeMetaWorldEnv):
    """tests/test_sims.py's fake, seeding ``np_random`` on reset as Meta-World's envs do (the
    fake's own test does not need it)."""

    def reset(self, *, seed=None, options=None):
        gym.Env.reset(self, seed=seed)
        return super().reset(seed=seed, options=options)


def test_metaworld_adapter_passes_the_checker(monkeypatch):
    import types

    monkeypatch.setitem(sys.modules, "metaworld", types.ModuleType("metaworld"))
    gym.register("Meta-World/MT1", entry_point=SeededFakeMetaWorldEnv)
    try:
        env = make("metaworld/reach-v3", seed=3)
        _check(env, (WRAPPED,))
        _assert_recreates(env)
        assert env.spec.kwargs == {"env_name": "reach-v3", "seed": 3}
    finally:
        gym.registry.pop("Meta-World/MT1", None)


class CpuSimFakeManiSkillEnv(FakeManiSkillEnv):
    """ManiSkill on its CPU backend hands out its own ``elapsed_steps`` tensor in every info
    (``BaseEnv.get_info`` clones it on the GPU backend only) and increments it in place."""

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        return obs, reward, terminated, truncated, {**info, "elapsed_steps": self.elapsed}


@pytest.mark.parametrize("pixels", [None, 24])
@pytest.mark.parametrize("backend", ["gpu", "cpu"])
def test_maniskill_vector_env_is_batched_and_returns_fresh_data(fake_maniskill, monkeypatch, pixels, backend):  # noqa: F811
    # gymnasium has no check_env for vector envs: the spaces must be the single spaces batched,
    # reset/step must return data of those spaces and shapes, seeded resets must repeat, and no
    # two calls may return shared arrays (check_env's check_returned_data_not_reused)
    if backend == "cpu":
        monkeypatch.setattr(test_maniskill, "FakeManiSkillEnv", CpuSimFakeManiSkillEnv)
    n = 3
    envs = make(f"maniskill/{MANISKILL_TASK}", num_envs=n, pixels=pixels)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert envs.observation_space == gym.vector.utils.batch_space(envs.single_observation_space, n)
            assert envs.action_space == gym.vector.utils.batch_space(envs.single_action_space, n)
            envs.action_space.seed(0)
            obs, info = envs.reset(seed=[1, 2, 3])
            assert obs in envs.observation_space and isinstance(info, dict)
            again, _ = envs.reset(seed=[1, 2, 3])
            assert data_equivalence(obs, again, exact=True)
            calls = [(obs, info)]
            for _ in range(3):
                obs, reward, terminated, truncated, info = envs.step(envs.action_space.sample())
                assert obs in envs.observation_space
                assert reward.shape == (n,) and np.issubdtype(reward.dtype, np.floating)
                assert terminated.shape == truncated.shape == (n,)
                assert terminated.dtype == truncated.dtype == np.bool_
                assert all(np.asarray(v).shape[:1] == (n,) for v in info.values()), info
                calls.append((obs, info))
            calls.append(envs.reset(seed=[1, 2, 3]))
            for i, (obs_i, info_i) in enumerate(calls):
                for obs_j, info_j in calls[i + 1:]:
                    assert not data_shares_objects(obs_i, obs_j)
                    assert not data_shares_objects(info_i, info_j), (info_i, info_j)
    finally:
        envs.close()
