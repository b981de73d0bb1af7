"""Pixel observations (offscreen MuJoCo rendering), CNNPolicy, and PPO on dict observations.

Rendering needs a headless OpenGL backend: MUJOCO_GL=egl with Mesa (Debian: libegl1
libegl-mesa0 libgl1-mesa-dri) works without a GPU; ``ebrl.envs.make(..., pixels=)`` sets it.
"""

from __future__ import annotations

import itertools
import math
import threading

import gymnasium as gym
import numpy as np
import pytest
import torch

import ebrl
from ebrl.algos import PPO, Batch
from ebrl.envs import PixelObservation, make
from ebrl.policies import CNNPolicy

torch.set_num_threads(1)
TASK = "mujoco/InvertedPendulum-v5"


@pytest.fixture
def envs():
    """Collects envs to close (a GL context freed at interpreter exit prints EGL errors)."""
    made: list[gym.Env] = []
    yield made
    for env in made:
        env.close()


def _make(envs, *args, **kw):
    env = make(*args, **kw)
    envs.append(env)
    return env


# ---- the wrapper ------------------------------------------------------------------------------


def test_pixel_env_gives_uint8_frames_and_state_and_frames_change(envs):
    env = _make(envs, TASK, pixels=32)
    space = env.observation_space
    assert isinstance(space, gym.spaces.Dict) and set(space.spaces) == {"pixels", "state"}
    assert space["pixels"].shape == (32, 32, 3) and space["pixels"].dtype == np.uint8
    assert space["state"].shape == (4,) and space["state"].dtype == np.float32

    obs, _ = env.reset(seed=0)
    assert obs["pixels"].shape == (32, 32, 3) and obs["pixels"].dtype == np.uint8
    assert obs["state"].shape == (4,) and obs["state"].dtype == np.float32
    assert obs["pixels"].max() > 0, "a black frame: the GL context was not current"
    assert space.contains(obs)

    frames = [obs["pixels"]]
    for _ in range(5):
        obs, *_ = env.step(np.array([3.0], np.float32))  # push the cart: the picture must move
        frames.append(obs["pixels"])
    assert not np.array_equal(frames[0], frames[-1])
    assert all(f is not g for f, g in itertools.pairwise(frames))  # fresh arrays, never reused


def test_frame_stack_fills_on_reset_and_slides(envs):
    env = _make(envs, TASK, pixels=32, frame_stack=2)
    assert env.observation_space["pixels"].shape == (32, 32, 6)
    o0, _ = env.reset(seed=0)
    assert o0["pixels"].shape == (32, 32, 6) and o0["pixels"].dtype == np.uint8
    assert np.array_equal(o0["pixels"][..., :3], o0["pixels"][..., 3:])  # filled with the first frame
    o1, *_ = env.step(np.array([3.0], np.float32))
    o2, *_ = env.step(np.array([3.0], np.float32))
    assert np.array_equal(o2["pixels"][..., :3], o1["pixels"][..., 3:])  # oldest first, newest last
    assert not np.array_equal(o2["pixels"][..., 3:], o0["pixels"][..., 3:])
    o3, _ = env.reset(seed=1)
    assert np.array_equal(o3["pixels"][..., :3], o3["pixels"][..., 3:])


def test_keep_state_false_and_argument_errors(envs):
    env = _make(envs, TASK, pixels=(24, 40), keep_state=False)
    assert set(env.observation_space.spaces) == {"pixels"}
    obs, _ = env.reset(seed=0)
    assert set(obs) == {"pixels"} and obs["pixels"].shape == (24, 40, 3)
    with pytest.raises(ValueError, match="pixels="):
        make(TASK, frame_stack=2)
    with pytest.raises(ValueError, match="render_mode"):
        PixelObservation(gym.make("InvertedPendulum-v5"))
    with pytest.raises(ValueError, match="frame_stack"):
        PixelObservation(gym.make("InvertedPendulum-v5", render_mode="rgb_array", width=8, height=8), frame_stack=0)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # gymnasium's half-built viewer
def test_a_render_failure_says_what_to_install(envs, monkeypatch):
    monkeypatch.setenv("MUJOCO_GL", "no-such-backend")  # read when the first frame is rendered
    env = _make(envs, TASK, pixels=16)
    with pytest.raises(RuntimeError, match="MUJOCO_GL='no-such-backend'.*libegl1"):
        env.reset(seed=0)


def test_an_env_renders_correctly_from_another_thread(envs):
    """The thread sim backend steps an env on any of its threads; gymnasium alone would render
    black frames there (the GL context stays current in the creating thread)."""
    here, there = _make(envs, TASK, pixels=32), _make(envs, TASK, pixels=32)
    a, b = here.reset(seed=3)[0], there.reset(seed=3)[0]
    assert np.array_equal(a["pixels"], b["pixels"])
    out = {}
    act = np.array([2.0], np.float32)
    thread = threading.Thread(target=lambda: out.update(obs=there.step(act)[0]))
    thread.start()
    thread.join()
    mine = here.step(act)[0]
    assert out["obs"]["pixels"].max() > 0
    assert np.array_equal(out["obs"]["pixels"], mine["pixels"])
    assert np.array_equal(there.step(act)[0]["pixels"], here.step(act)[0]["pixels"])  # and back here


# ---- CNNPolicy --------------------------------------------------------------------------------


def _dict_space(px=32, ch=3, state=4):
    entries = {"pixels": gym.spaces.Box(0, 255, (px, px, ch), np.uint8)}
    if state:
        entries["state"] = gym.spaces.Box(-np.inf, np.inf, (state,), np.float32)
    return gym.spaces.Dict(entries)


def _obs(B, px=32, ch=3, state=4, seed=0):
    rng = np.random.default_rng(seed)
    obs = {"pixels": rng.integers(0, 256, (B, px, px, ch), dtype=np.uint8)}
    if state:
        obs["state"] = rng.normal(size=(B, state)).astype(np.float32)
    return obs


def test_cnn_policy_act_shapes_dtypes_bounds_and_seeding():
    act_space = gym.spaces.Box(-0.5, 0.5, (2,), np.float32)
    p = CNNPolicy.from_spaces(_dict_space(ch=6), act_space, seed=0, init_log_std=1.0)
    obs = _obs(5, ch=6)
    out = p.act(obs)
    assert out.actions.shape == (5, 2) and out.actions.dtype == np.float32
    assert out.env_actions.shape == (5, 2) and np.abs(out.env_actions).max() <= 0.5
    assert np.abs(out.actions).max() > 0.5  # std e^1: unclipped samples leave the bounds
    assert out.logprobs.shape == (5,) and out.logprobs.dtype == np.float32
    assert out.values.shape == (5,) and out.values.dtype == np.float32
    twin = CNNPolicy.from_spaces(_dict_space(ch=6), act_space, seed=0, init_log_std=1.0)
    assert np.array_equal(twin.act(obs).actions, out.actions)  # same seed: same weights and stream
    assert not np.array_equal(p.act(obs).actions, out.actions)  # the stream moves on

    # evaluate() agrees with act(): same log-probs and values for the sampled actions
    t_obs = {k: torch.from_numpy(v) for k, v in obs.items()}
    logp, ent, v = twin.evaluate(t_obs, torch.from_numpy(out.actions))
    assert torch.allclose(logp, torch.from_numpy(out.logprobs), atol=1e-5)
    assert torch.allclose(v, torch.from_numpy(out.values), atol=1e-5)
    assert ent.shape == (5,) and twin.value(t_obs).shape == (5,)


def test_cnn_policy_discrete_pixels_only_and_84px():
    p = CNNPolicy.from_spaces(_dict_space(px=84, state=0), gym.spaces.Discrete(4), seed=1)
    out = p.act(_obs(3, px=84, state=0))
    assert out.actions.shape == (3,) and out.actions.dtype == np.int64
    assert set(out.actions.tolist()) <= {0, 1, 2, 3}
    assert p.obs_encoder.images[0][0][0].stride == (4, 4)  # NatureCNN at 84 px
    logp, ent, _ = p.evaluate({"pixels": torch.from_numpy(_obs(3, px=84, state=0)["pixels"])},
                              torch.from_numpy(out.actions))
    assert torch.all(ent > 0) and torch.all(logp <= 0)
    with pytest.raises(ValueError, match="needs an image entry"):
        CNNPolicy.from_spaces(gym.spaces.Box(0, 1, (3,)), gym.spaces.Discrete(2))


def test_cnn_policy_state_normalisation_travels_with_state_dict():
    p = CNNPolicy.from_spaces(_dict_space(), gym.spaces.Box(-1, 1, (1,)), seed=0)
    state = torch.randn(256, 4) * 3 + 5
    p.update_obs_stats({"pixels": torch.zeros(256, 32, 32, 3, dtype=torch.uint8), "state": state})
    assert torch.allclose(p.obs_encoder.obs_mean, state.mean(0), atol=1e-3)
    q = CNNPolicy.from_spaces(_dict_space(), gym.spaces.Box(-1, 1, (1,)), seed=9)
    q.load_state_dict(p.state_dict())
    obs = {k: torch.from_numpy(v) for k, v in _obs(4).items()}
    assert torch.equal(q.value(obs), p.value(obs))


# ---- PPO on dict observations -----------------------------------------------------------------


def test_ppo_update_on_a_batch_with_dict_observations():
    torch.manual_seed(0)
    policy = CNNPolicy.from_spaces(_dict_space(), gym.spaces.Box(-1, 1, (1,)), seed=0)
    S, T = 3, 6

    def obs(*lead):
        return {"pixels": torch.randint(0, 256, (*lead, 32, 32, 3), dtype=torch.uint8),
                "state": torch.randn(*lead, 4)}

    o, acts = obs(S, T), torch.randn(S, T, 1)
    with torch.no_grad():
        logp, _, v = policy.evaluate({k: x.reshape(S * T, *x.shape[2:]) for k, x in o.items()},
                                     acts.reshape(-1, 1))
    mask = torch.ones(S, T, dtype=torch.bool)
    mask[2, 4:] = False  # a short segment
    truncated = torch.zeros(S, T, dtype=torch.bool)
    truncated[0, 2] = True  # a time-limit end that bootstraps from final_obs
    batch = Batch(o, acts, logp.reshape(S, T), v.reshape(S, T), torch.randn(S, T),
                  torch.zeros(S, T, dtype=torch.bool), truncated, mask, torch.zeros(S, T, dtype=torch.long),
                  obs(S), obs(1), torch.tensor([[0, 2]]))
    before = [t.clone() for t in policy.parameters()]
    metrics = PPO(lr=1e-3, minibatch_size=4, update_epochs=2).update(policy, batch)
    assert metrics["num_steps"] == 16.0
    assert all(math.isfinite(metrics[k]) for k in ("policy_loss", "value_loss", "approx_kl", "entropy"))
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters()))
    assert torch.allclose(policy.obs_encoder.obs_mean, o["state"][mask].mean(0).double().float(), atol=1e-3)


# ---- end to end -------------------------------------------------------------------------------


def test_pixel_ppo_runs_end_to_end_through_the_runtime():
    env_fn = lambda i: make(TASK, pixels=32)  # noqa: E731
    probe = env_fn(0)
    policy = CNNPolicy.from_spaces(probe.observation_space, probe.action_space, seed=0)
    probe.close()
    cfg = ebrl.RunConfig(num_envs=2, segment_len=16, total_env_steps=128, sim={"backend": "thread"})
    res = ebrl.run_sync(ebrl.Trainer(env_fn, policy, PPO(minibatch_size=64), cfg))
    assert res.env_steps == 128 and res.trained == 128
    assert res.updates >= 1 and math.isfinite(res.metrics["value_loss"])


def test_robotics_envs_render_pixels_next_to_their_flat_state_and_keep_is_success():
    env = make("robotics/FetchReachDense-v4", pixels=32)
    obs, _ = env.reset(seed=0)
    assert obs["pixels"].shape == (32, 32, 3) and obs["pixels"].dtype == np.uint8
    assert obs["state"].shape == (16,) and obs["pixels"].std() > 10  # a real frame, not a black one
    _, _, _, _, info = env.step(env.action_space.sample())
    assert "is_success" in info
    env.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["auto", "process"])
def test_runs_that_render_in_children_after_this_process_rendered_never_hang(envs, backend, no_leaks):
    """The hang of a forked child rendering in a process that had rendered (its EGL state and
    llvmpipe threads do not survive a fork): the probe and the workers come from a fork server
    instead, twice in a row."""
    from ebrl.runtime.children import fork_hazard
    from ebrl.testing import MockPolicy, NoopAlgo

    here = _make(envs, TASK, pixels=16)
    here.reset(seed=0)  # rendered in this process: Mesa's EGL is loaded and set up
    assert fork_hazard() is not None
    for _ in range(2):
        res = ebrl.run_sync(ebrl.Trainer(
            lambda i: make(TASK, pixels=16), MockPolicy(act_dim=1, random=True), NoopAlgo(),
            ebrl.RunConfig(num_envs=2, segment_len=8, total_env_steps=64,
                           sim={"backend": backend, "num_workers": 2}, faults={"build_timeout_s": 60})))
        assert res.env_steps == 64 and res.accounting_ok()
