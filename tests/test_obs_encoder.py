"""Policies read any observation dict (ebrl.policies.encoders): cameras and vectors found by their
spaces, whatever their keys, nested or not; old weights still load."""

import copy
import functools
import json
import math

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.spaces import Box, Dict, Discrete, Graph, MultiBinary, MultiDiscrete, Text

import ebrl
from ebrl.algos import PPO
from ebrl.cli import main
from ebrl.runs import build_policy
from ebrl.config import ConfigError
from ebrl.policies import CNNPolicy, FlowPolicy, MLPPolicy, TokenPolicy, check_policy_spaces
from ebrl.policies.encoders import ObsEncoder, ObsLayout
from ebrl.spaces import stack

ACT = Box(-1.0, 1.0, (2,), np.float32)


def camera(shape):
    return Box(0, 255, shape, np.uint8)


# a user's own env, as the issue tried it
USER = Dict({"image": camera((48, 48, 3)), "proprio": Box(-1, 1, (5,))})
# ManiSkill nests its cameras under sensor_data/<camera>/rgb, next to agent and extra state
MANISKILL = Dict({"agent": Dict({"qpos": Box(-1, 1, (9,)), "qvel": Box(-1, 1, (9,))}),
                  "extra": Dict({"tcp_pose": Box(-1, 1, (7,))}),
                  "sensor_data": Dict({"base_camera": Dict({"rgb": camera((32, 32, 3))}),
                                       "hand_camera": Dict({"rgb": camera((32, 32, 3))})})})
# LeRobot datasets name flat keys with dots; cameras channels first
LEROBOT = Dict({"observation.images.top": camera((3, 32, 32)), "observation.images.wrist": camera((3, 32, 32)),
                "observation.state": Box(-1, 1, (6,))})
SPACES = {"user": USER, "maniskill": MANISKILL, "lerobot": LEROBOT}
F = 32  # features per camera in these tests
# what the spaces say: F per camera, then every vector element
EXPECTED_DIM = {"user": F + 5, "maniskill": 2 * F + 9 + 9 + 7, "lerobot": 2 * F + 6}
SMALL_CNN = {"feature_dim": F, "hidden": (32,), "conv": ((8, 3, 2), (16, 3, 2))}


def batch(space: gym.Space, n: int, seed: int = 0):
    """``n`` samples of ``space`` stacked, nested as the space is."""
    space = copy.deepcopy(space)
    space.seed(seed)
    return stack([space.sample() for _ in range(n)])


class DictObsEnv(gym.Env):
    """Emits samples of ``space``; the reward asks for small actions. Episodes of 16 steps."""

    def __init__(self, space: gym.Space, episode_len: int = 16):
        self.observation_space = copy.deepcopy(space)  # each env its own sampling stream
        self.action_space = ACT
        self.episode_len, self.t = episode_len, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.observation_space.seed(int(self.np_random.integers(2**31)))
        self.t = 0
        return self.observation_space.sample(), {}

    def step(self, action):
        self.t += 1
        reward = -float(np.square(action).sum())
        return self.observation_space.sample(), reward, False, self.t >= self.episode_len, {}


for _name, _space in SPACES.items():  # for the CLI: ebrl.envs.make falls through to gymnasium's registry
    if f"ebrltest/{_name}-v0" not in gym.registry:
        gym.register(f"ebrltest/{_name}-v0", entry_point=functools.partial(DictObsEnv, _space))


# ---- the encoder reads what the spaces say -------------------------------------------------------


@pytest.mark.parametrize("name", SPACES)
def test_cnn_reads_every_camera_and_vector_and_the_feature_size_is_what_the_spaces_say(name):
    space = SPACES[name]
    policy = CNNPolicy.from_spaces(space, ACT, seed=0, **SMALL_CNN)
    assert policy.obs_encoder.out_dim == EXPECTED_DIM[name]
    cameras = [d["key"] for d in policy.describe_inputs() if d["as"] == "image"]
    assert cameras == {"user": ["image"], "lerobot": ["observation.images.top", "observation.images.wrist"],
                       "maniskill": ["sensor_data/base_camera/rgb", "sensor_data/hand_camera/rgb"]}[name]
    obs = batch(space, 4)
    assert policy.obs_encoder(obs).shape == (4, EXPECTED_DIM[name])
    out = policy.act(obs)
    assert out.actions.shape == (4, 2) and out.values.shape == (4,)
    check_policy_spaces(policy, space, ACT)  # nested keys included
    # and it is what ebrl.run checks: a space missing a camera is named
    if name == "maniskill":
        one_camera = copy.deepcopy(space)
        del one_camera["sensor_data"].spaces["hand_camera"]
        with pytest.raises(ConfigError, match="sensor_data/hand_camera/rgb"):
            check_policy_spaces(policy, one_camera, ACT)


def test_libero_style_keys_need_no_renaming():
    space = Dict({"agentview_image": camera((64, 64, 3)), "robot0_eye_in_hand_image": camera((64, 64, 3)),
                  "robot0_proprio-state": Box(-np.inf, np.inf, (39,)), "object-state": Box(-np.inf, np.inf, (10,))})
    policy = CNNPolicy.from_spaces(space, Box(-1, 1, (7,)), **SMALL_CNN)
    assert [(d["key"], d["as"]) for d in policy.describe_inputs()] == [
        ("agentview_image", "image"), ("robot0_eye_in_hand_image", "image"), ("object-state", "vector"),
        ("robot0_proprio-state", "vector")]
    assert policy.obs_encoder.out_dim == 2 * F + 49 and policy.act(batch(space, 2)).actions.shape == (2, 7)


def test_the_order_is_images_then_vectors_then_one_hot_depth_first_in_the_spaces_order():
    layout = ObsLayout.from_space(MANISKILL)
    assert [e.key for e in layout.entries] == ["sensor_data/base_camera/rgb", "sensor_data/hand_camera/rgb",
                                              "agent/qpos", "agent/qvel", "extra/tcp_pose"]
    assert layout.flat_dim == 25 and layout.ignored == ()


def test_nested_and_slash_joined_observations_read_alike():
    policy = CNNPolicy.from_spaces(MANISKILL, ACT, seed=0, **SMALL_CNN)
    nested = batch(MANISKILL, 3)
    flat = {"agent/qpos": nested["agent"]["qpos"], "agent/qvel": nested["agent"]["qvel"],
            "extra": nested["extra"], "sensor_data/base_camera/rgb": nested["sensor_data"]["base_camera"]["rgb"],
            "sensor_data/hand_camera": nested["sensor_data"]["hand_camera"]}
    torch.testing.assert_close(policy.obs_encoder(flat), policy.obs_encoder(nested), rtol=0, atol=0)
    with pytest.raises(KeyError, match="no entry 'agent/qvel'"):
        policy.obs_encoder({k: v for k, v in flat.items() if k != "agent/qvel"})


def test_chw_and_hwc_cameras_give_the_same_encoder():
    hwc = CNNPolicy.from_spaces(Dict({"cam": camera((24, 32, 3))}), ACT, seed=0, **SMALL_CNN)
    chw = CNNPolicy.from_spaces(Dict({"cam": camera((3, 24, 32))}), ACT, seed=0, **SMALL_CNN)
    assert hwc.obs_encoder.out_dim == chw.obs_encoder.out_dim == F
    assert {k: v.shape for k, v in hwc.state_dict().items()} == {k: v.shape for k, v in chw.state_dict().items()}
    frames = batch(Dict({"cam": camera((24, 32, 3))}), 2)["cam"]
    # the same weights (same seed) see the same picture
    torch.testing.assert_close(hwc.obs_encoder({"cam": frames}),
                               chw.obs_encoder({"cam": frames.transpose(0, 3, 1, 2)}), rtol=0, atol=0)
    assert [d["channels"] for d in (hwc.describe_inputs()[0], chw.describe_inputs()[0])] == ["last", "first"]


def test_a_float_image_is_a_vector_unless_image_keys_names_it():
    space = Dict({"depth": Box(0.0, 1.0, (16, 16, 1), np.float32), "state": Box(-1, 1, (3,))})
    with pytest.raises(ValueError, match="needs an image entry.*image_keys"):
        CNNPolicy.from_spaces(space, ACT)
    assert MLPPolicy.from_spaces(space, ACT).obs_dim == 16 * 16 + 3
    policy = CNNPolicy.from_spaces(space, ACT, image_keys=["depth"], **SMALL_CNN)
    assert [e.key for e in policy.obs_layout.images] == ["depth"]
    assert policy.obs_encoder.out_dim == F + 3
    obs = batch(space, 2)
    pixels = policy.obs_encoder.pixels(obs)[0]  # floats are not scaled by 1/255
    torch.testing.assert_close(pixels, torch.from_numpy(obs["depth"]).permute(0, 3, 1, 2))
    assert policy.act(obs).actions.shape == (2, 2)


def test_discrete_multidiscrete_and_multibinary_entries_are_one_hot():
    space = Dict({"flags": MultiBinary(4), "grid": MultiDiscrete([2, 3]), "mode": Discrete(3, start=1),
                  "x": Box(-1, 1, (2,))})
    layout = ObsLayout.from_space(space)
    assert [(e.key, e.read.value) for e in layout.entries] == [("x", "vector"), ("flags", "binary"),
                                                               ("grid", "one-hot"), ("mode", "one-hot")]
    assert layout.vector_dim == 2 and layout.flat_dim == 2 + 4 + 5 + 3
    encoder = ObsEncoder(layout)
    obs = {"flags": np.array([[1, 0, 0, 1]]), "grid": np.array([[1, 2]]), "mode": np.array([2]),
           "x": np.array([[0.5, -0.5]], np.float32)}
    expected = [0.5, -0.5, 1, 0, 0, 1, 0, 1, 0, 0, 1, 0, 1, 0]  # x (unit statistics), flags, grid, mode - 1
    torch.testing.assert_close(encoder.vector(obs), torch.tensor([expected]))
    encoder.update_stats({**obs, "x": np.array([[3.0, 3.0], [5.0, 5.0]], np.float32)})
    assert encoder.obs_mean.tolist() == pytest.approx([4.0, 4.0], abs=1e-3)  # the Box part only
    torch.testing.assert_close(encoder.vector(obs)[:, 2:], torch.tensor([expected[2:]], dtype=torch.float32))
    policy = MLPPolicy.from_spaces(space, Discrete(2), seed=0)
    assert policy.act(obs).actions.shape == (1,)
    check_policy_spaces(policy, space, Discrete(2))
    with pytest.raises(ConfigError, match="'mode'.*categorical"):
        check_policy_spaces(policy, Dict({**space.spaces, "mode": Discrete(4)}), Discrete(2))


def test_an_entry_nothing_reads_is_one_error_naming_its_key_and_space():
    space = Dict({"state": Box(-1, 1, (3,)), "lang": Text(16),
                  "sensor_data": Dict({"depth": Box(0, 255, (32, 32), np.uint8), "rgb": camera((32, 32, 3))})})
    for cls in (CNNPolicy, MLPPolicy, TokenPolicy, FlowPolicy):
        with pytest.raises(ValueError, match=r"entries 'lang', Text\(.*'sensor_data/depth', Box\(0, 255, \(32, 32\), "
                                             r"uint8\): a 2-D uint8 Box is not an image.*state_keys"):
            cls.from_spaces(space, ACT)
    with pytest.raises(ConfigError, match="policy.kind='auto'.*'lang', Text"):
        build_policy(space, ACT, {})
    graph = Dict({"scene": Graph(Box(0, 1, (2,)), None), "state": Box(-1, 1, (3,))})
    with pytest.raises(ValueError, match="entry 'scene', Graph"):
        MLPPolicy.from_spaces(graph, ACT)
    # choosing the entries to read leaves the others out; a 2-D uint8 named in state_keys is flattened
    policy = MLPPolicy.from_spaces(space, ACT, state_keys=["state", "sensor_data/depth"])
    assert policy.obs_dim == 3 + 32 * 32 and set(policy.obs_layout.ignored) == {"lang", "sensor_data/rgb"}
    assert {"key": "lang", "as": "ignored"} in policy.describe_inputs()


def test_image_keys_and_state_keys_choose_in_the_order_given():
    layout = ObsLayout.from_space(MANISKILL, image_keys=["sensor_data/hand_camera"], state_keys=["extra", "agent/qpos"])
    assert [e.key for e in layout.entries] == ["sensor_data/hand_camera/rgb", "extra/tcp_pose", "agent/qpos"]
    assert set(layout.ignored) == {"agent/qvel", "sensor_data/base_camera/rgb"}  # an unnamed camera is never flattened
    with pytest.raises(ValueError, match="state_keys names 'agent/qacc'.*'agent/qpos'"):
        ObsLayout.from_space(MANISKILL, state_keys=["agent/qacc"])
    with pytest.raises(ValueError, match="both image_keys and state_keys"):
        ObsLayout.from_space(USER, image_keys=["image"], state_keys=["image"])
    with pytest.raises(ValueError, match="is read whole"):
        ObsLayout.from_space(Box(-1, 1, (3,)), state_keys=["x"])


def test_auto_picks_the_cnn_whenever_there_is_an_image():
    assert isinstance(build_policy(MANISKILL, ACT, {"feature_dim": F}), CNNPolicy)
    assert isinstance(build_policy(camera((36, 36, 3)), ACT, {"feature_dim": F}), CNNPolicy)
    assert isinstance(build_policy(Box(0, 255, (8, 8), np.uint8), ACT, {}), MLPPolicy)  # a Box is read whole
    assert isinstance(build_policy(Dict({"a": Box(-1, 1, (3,)), "b": Discrete(2)}), ACT, {}), MLPPolicy)
    depth = Dict({"depth": Box(0.0, 1.0, (16, 16, 1)), "s": Box(-1, 1, (2,))})
    assert isinstance(build_policy(depth, ACT, {}), MLPPolicy)
    assert isinstance(build_policy(depth, ACT, {"image_keys": ["depth"], **SMALL_CNN}), CNNPolicy)
    with pytest.raises(ConfigError, match="MLPPolicy has no image encoder.*'image'.*CNNPolicy"):
        build_policy(USER, ACT, {"kind": "mlp"})


def test_observation_normalisation_covers_the_vector_part():
    policy = CNNPolicy.from_spaces(USER, ACT, seed=0, **SMALL_CNN)
    obs = batch(USER, 256)
    proprio = np.random.default_rng(0).normal(5.0, 3.0, (256, 5)).astype(np.float32)
    policy.update_obs_stats({**obs, "proprio": torch.from_numpy(proprio)})
    assert policy.obs_encoder.obs_mean.shape == (5,)
    np.testing.assert_allclose(policy.obs_encoder.obs_mean.numpy(), proprio.mean(0), rtol=1e-4)
    assert policy.state_dict()["obs_encoder.obs_count"].item() == pytest.approx(256, abs=1e-3)
    policy.update_obs_stats({k: v[:0] for k, v in obs.items()})  # no rows (a data-parallel rank's): nothing merged
    assert policy.state_dict()["obs_encoder.obs_count"].item() == pytest.approx(256, abs=1e-3)


# ---- token and flow policies read the same dicts ------------------------------------------------


@pytest.mark.parametrize("name", SPACES)
def test_token_and_flow_policies_accept_the_same_dicts(name):
    space, obs = SPACES[name], batch(SPACES[name], 3)
    cameras = {"user": 1, "maniskill": 2, "lerobot": 2}[name]
    token = TokenPolicy.from_spaces(space, ACT, d_model=32, layers=1, pixel_grid=2, seed=0)
    assert token.num_prefix == 1 + cameras * 4  # the vectors' token, then 2x2 patches per camera
    out = token.act(obs)
    assert out.actions.shape == (3, 2) and out.logprobs.shape == (3,)
    logp, _, _ = token.evaluate(obs, torch.from_numpy(out.actions))
    np.testing.assert_allclose(logp.detach().numpy(), out.logprobs, atol=1e-4)

    flow = FlowPolicy.from_spaces(space, ACT, hidden=(32,), noise_hidden=(16,), critic_hidden=(16,),
                                  feature_dim=F, conv=((8, 3, 2), (16, 3, 2)), seed=0)
    assert flow.obs_dim == EXPECTED_DIM[name]
    out = flow.act(obs)
    assert out.env_actions.shape == (3, 2) and np.isfinite(out.logprobs).all()
    logp, _, _ = flow.evaluate(obs, torch.from_numpy(out.actions))
    np.testing.assert_allclose(logp.detach().numpy(), out.logprobs, rtol=1e-4, atol=1e-3)


def test_token_and_flow_layouts_survive_save_and_load(tmp_path):
    token = TokenPolicy.from_spaces(MANISKILL, ACT, d_model=32, layers=1, seed=0)
    flow = FlowPolicy.from_spaces(LEROBOT, ACT, hidden=(16,), noise_hidden=(8,), critic_hidden=(8,),
                                  feature_dim=F, conv=((8, 3, 2), (16, 3, 2)), seed=0)
    for policy, space in ((token, MANISKILL), (flow, LEROBOT)):
        policy.update_obs_stats(batch(space, 16))
        policy.save_pretrained(tmp_path / type(policy).__name__)
        loaded = type(policy).from_pretrained(tmp_path / type(policy).__name__)
        assert loaded.obs_layout == policy.obs_layout
        obs = batch(space, 4, seed=1)
        torch.testing.assert_close(loaded.value(obs), policy.value(obs))


# ---- weights that are not the policy's ------------------------------------------------------------


def test_weights_under_other_names_are_refused_naming_them():
    # the statistics outside the encoder: every key the policy lacks and every key it did not expect is named
    policy = MLPPolicy(3, 2, seed=0)
    renamed = {k.removeprefix("obs_encoder."): v for k, v in policy.state_dict().items()}
    with pytest.raises(RuntimeError, match="Missing key") as refused:
        MLPPolicy(3, 2, seed=1).load_state_dict(renamed)
    message = str(refused.value)
    assert all(f'"obs_encoder.{k}"' in message and f'"{k}"' in message for k in ("obs_mean", "obs_var", "obs_count"))
    assert "Unexpected key" in message


def test_a_saved_policy_whose_config_or_weights_are_not_its_own_is_refused_naming_the_keys(tmp_path):
    # a config.json without a key the policy saves: tests/test_token_policy.py
    from safetensors.torch import load_file, save_file

    from ebrl.policies.pretrained import CONFIG_NAME, WEIGHTS_NAME

    flow = FlowPolicy.from_spaces(Box(-1, 1, (4,)), ACT, hidden=(16,), noise_hidden=(8,), critic_hidden=(8,), seed=2)
    flow.save_pretrained(tmp_path)
    config = json.loads((tmp_path / CONFIG_NAME).read_text())
    (tmp_path / CONFIG_NAME).write_text(json.dumps({**config, "dict_obs": True}))  # a TokenPolicy argument
    with pytest.raises(ValueError, match=r"has keys FlowPolicy does not take: \['dict_obs'\]"):
        FlowPolicy.from_pretrained(tmp_path)
    (tmp_path / CONFIG_NAME).write_text(json.dumps(config))
    weights = load_file(str(tmp_path / WEIGHTS_NAME))
    save_file({k.removeprefix("obs_encoder."): v for k, v in weights.items()}, str(tmp_path / WEIGHTS_NAME))
    with pytest.raises(RuntimeError, match='Unexpected key.*"obs_mean"'):
        FlowPolicy.from_pretrained(tmp_path)


# ---- end to end: ebrl.run and the CLI -------------------------------------------------------------


@pytest.mark.parametrize("name, sim, learner", [("user", "thread", "thread"), ("maniskill", "process", "process"),
                                                ("lerobot", "inline", "thread")])
def test_trains_under_ebrl_run(name, sim, learner, no_leaks):
    space = SPACES[name]
    policy = CNNPolicy.from_spaces(space, ACT, seed=0, **SMALL_CNN)
    cfg = ebrl.RunConfig(num_envs=4, segment_len=16, total_env_steps=256, learner=learner,
                         sim={"backend": sim, **({"num_workers": 2} if sim == "process" else {})})
    before = policy.obs_encoder.obs_mean.clone()
    res = ebrl.run_sync(ebrl.Trainer(lambda i: DictObsEnv(space), policy, PPO(minibatch_size=64), cfg))
    assert res.env_steps == res.trained == 256 and res.updates >= 1
    assert math.isfinite(res.metrics["value_loss"]) and math.isfinite(res.metrics["policy_loss"])
    assert not torch.equal(before, policy.obs_encoder.obs_mean)  # the vectors' statistics were updated


def test_one_hot_entries_train_under_ebrl_run(no_leaks):
    space = Dict({"flags": MultiBinary(3), "mode": Discrete(3), "x": Box(-1, 1, (2,))})
    policy = MLPPolicy.from_spaces(space, ACT, seed=0)
    assert policy.obs_dim == 3 + 3 + 2
    cfg = ebrl.RunConfig(num_envs=4, segment_len=16, total_env_steps=256, learner="thread",
                         sim={"backend": "process", "num_workers": 2})
    res = ebrl.run_sync(ebrl.Trainer(lambda i: DictObsEnv(space), policy, PPO(minibatch_size=64), cfg))
    assert res.env_steps == res.trained == 256 and math.isfinite(res.metrics["value_loss"])


@pytest.mark.parametrize("name", SPACES)
def test_trains_from_the_cli_with_policy_kind_auto(name, tmp_path):
    code = main(["train", "--quiet", "--log-dir", str(tmp_path), "--set", f"env=ebrltest/{name}-v0",
                 "--set", "run.num_envs=2", "--set", "run.segment_len=16", "--set", "run.total_env_steps=64",
                 "--set", "run.sim.backend=thread", "--set", "run.learner=thread", "--set", "ppo.minibatch_size=16",
                 "--set", f"policy.feature_dim={F}", "--set", "policy.hidden=[32]",
                 "--set", "policy.conv=[[8, 3, 2], [16, 3, 2]]"])
    assert code == 0
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["env_steps"] == result["trained"] == 64 and result["updates"] >= 1
    # what the policy reads, in spec.json and in one log line at the start
    inputs = json.loads((tmp_path / "spec.json").read_text())["policy_inputs"]
    assert [d["key"] for d in inputs] == [e.key for e in ObsLayout.from_space(SPACES[name]).entries]
    assert sum(d.get("features", 0) for d in inputs) == {"user": 1, "maniskill": 2, "lerobot": 2}[name] * F
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    logged = [e for e in events if e["event"] == "policy_inputs"]
    assert len(logged) == 1 and logged[0]["policy"] == "CNNPolicy" and logged[0]["inputs"] == inputs
