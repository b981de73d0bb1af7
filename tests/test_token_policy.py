"""TokenPolicy: autoregressive action tokens (OpenVLA style) with a KV-cache decoder."""

import gymnasium as gym
import numpy as np
import pytest
import torch

import ebrl
from ebrl.algos import PPO, Batch
from ebrl.envs.chunks import ActionChunk
from ebrl.policies.token import TokenPolicy
from ebrl.testing import MockEnv
from tests.policy_helpers import token_logits

SMALL = {"d_model": 32, "layers": 2, "heads": 4}


def sharpen(policy: TokenPolicy, seed: int = 1) -> TokenPolicy:
    """Random, non-uniform token logits: the freshly built head is zero (uniform over the bins),
    which would make every log-prob check trivially pass."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return policy


def dict_space() -> gym.spaces.Dict:
    return gym.spaces.Dict({
        "pixels": gym.spaces.Box(0, 255, (16, 16, 3), np.uint8),
        "state": gym.spaces.Box(-np.inf, np.inf, (5,), np.float32),
        "instruction": gym.spaces.Box(-1.0, 1.0, (12,), np.float32),
    })


def dict_obs(n: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"pixels": rng.integers(0, 256, (n, 16, 16, 3), dtype=np.uint8),
            "state": rng.standard_normal((n, 5)).astype(np.float32),
            "instruction": rng.uniform(-1, 1, (n, 12)).astype(np.float32)}


def torch_obs(obs):
    return {k: torch.from_numpy(v) for k, v in obs.items()} if isinstance(obs, dict) else torch.from_numpy(obs)


def test_default_parameter_count_for_mock_env_spaces():
    env = MockEnv()  # Box(4,) observations, Box(-1, 1, (4,)) actions
    policy = TokenPolicy.from_spaces(env.observation_space, env.action_space)
    count = sum(p.numel() for p in policy.parameters())
    print(f"TokenPolicy default parameters (MockEnv dim=4): {count:,}")
    # d_model=128, 4 blocks of ~198k; the token embedding and head read 32 bin cosines (4k each)
    assert count == 803_105
    plain = TokenPolicy.from_spaces(env.observation_space, env.action_space, bin_basis=0)
    # one free embedding row and logit per bin: 256 * 128 each way, plus the 256 biases
    assert sum(p.numel() for p in plain.parameters()) == count + 2 * 256 * 128 + 256 - 2 * 32 * 128 - 32
    assert count < 5_000_000


@pytest.mark.parametrize("space", ["flat", "chunk", "dict"])
def test_act_logprobs_are_the_sum_of_teacher_forced_token_logprobs(space):
    if space == "dict":
        obs_space, act_space, obs = dict_space(), gym.spaces.Box(-1.0, 1.0, (3,)), dict_obs(6)
    else:
        obs_space = gym.spaces.Box(-1.0, 1.0, (4,))
        act_space = gym.spaces.Box(-1.0, 1.0, (3,) if space == "flat" else (2, 3))
        obs = np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32)
    policy = sharpen(TokenPolicy.from_spaces(obs_space, act_space, **SMALL))
    out = policy.act(obs)
    assert out.actions.shape == (6, *act_space.shape) and out.actions.dtype == np.int64

    tokens = torch.from_numpy(out.actions)
    with torch.no_grad():
        logits, values = token_logits(policy, torch_obs(obs), tokens)
        logp_all = torch.log_softmax(logits, -1)  # [N, D, bins]
        ids = tokens.reshape(6, -1)
        by_hand = torch.stack([logp_all[n, j, ids[n, j]] for n in range(6) for j in range(ids.shape[1])])
        by_hand = by_hand.reshape(6, -1).sum(1)
        logp, entropy, value = policy.evaluate(torch_obs(obs), tokens)
    assert out.logprobs.dtype == np.float32 and out.values.dtype == np.float32
    assert np.all(out.logprobs < -1.0)  # not a degenerate distribution
    np.testing.assert_allclose(out.logprobs, by_hand.numpy(), atol=1e-5)
    np.testing.assert_allclose(out.logprobs, logp.numpy(), atol=1e-5)
    np.testing.assert_allclose(out.values, values.numpy(), atol=1e-5)
    np.testing.assert_allclose(out.values, value.numpy(), atol=1e-5)
    np.testing.assert_allclose(policy.value(torch_obs(obs)).detach().numpy(), out.values, atol=1e-5)
    assert entropy.shape == (6,) and bool((entropy > 0).all())


@pytest.mark.parametrize("bin_basis", [32, 0])
@pytest.mark.parametrize("space", ["flat", "chunk", "dict"])
def test_kv_cache_decode_equals_the_full_pass(space, bin_basis):
    if space == "dict":
        obs_space, act_space, obs = dict_space(), gym.spaces.Box(-1.0, 1.0, (4,)), dict_obs(5)
    else:
        obs_space = gym.spaces.Box(-1.0, 1.0, (3,))
        act_space = gym.spaces.Box(-1.0, 1.0, (4,) if space == "flat" else (3, 2))
        obs = np.random.default_rng(1).standard_normal((5, 3)).astype(np.float32)
    policy = sharpen(TokenPolicy.from_spaces(obs_space, act_space, **SMALL, state_tokens=2, bin_basis=bin_basis))
    forced = torch.randint(0, 256, (5, *act_space.shape), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full_logits, full_values = token_logits(policy, torch_obs(obs), forced)
    tokens, cached_logits, cached_values = policy.decode(obs, forced)
    assert torch.equal(tokens, forced.reshape(5, -1))
    assert cached_logits.shape == full_logits.shape == (5, forced[0].numel(), 256)
    torch.testing.assert_close(cached_logits, full_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cached_values, full_values, atol=1e-5, rtol=1e-5)

    # and for the policy's own samples: every step's logits are the teacher-forced ones
    sampled, logits, _ = policy.decode(obs)
    with torch.no_grad():
        torch.testing.assert_close(logits, token_logits(policy, torch_obs(obs), sampled)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bin_basis", [32, 0])
def test_raising_one_bins_logprob_moves_its_neighbours_alike_only_with_a_bin_basis(bin_basis):
    policy = TokenPolicy.from_spaces(gym.spaces.Box(-1.0, 1.0, (3,)), gym.spaces.Box(-1.0, 1.0, (2,)),
                                     **SMALL, bin_basis=bin_basis)
    obs = torch.from_numpy(np.random.default_rng(0).standard_normal((8, 3)).astype(np.float32))
    tokens = torch.full((8, 2), 100)
    before = token_logits(policy, obs, tokens)[0].detach().softmax(-1)[:, 0]  # dimension 0: [8, bins]
    opt = torch.optim.SGD(policy.parameters(), lr=0.05)
    (-policy.evaluate(obs, tokens)[0].mean()).backward()
    opt.step()
    after = token_logits(policy, obs, tokens)[0].detach().softmax(-1)[:, 0]
    gain = (after / before).mean(0)
    assert gain[100] > 1.01  # the trained bin
    if bin_basis:  # a smooth tilt towards the trained bin: its neighbours rise with it, the far side falls
        assert torch.allclose(gain[98:103], gain[100].expand(5), rtol=0.02) and gain[255] < 1.0
    else:  # one free logit per bin: every other bin falls alike
        others = torch.cat([gain[:100], gain[101:]])
        assert (others < 1.0).all() and torch.allclose(others, others[0].expand_as(others), rtol=1e-4)
    with pytest.raises(ValueError, match="bin_basis"):
        TokenPolicy.from_spaces(gym.spaces.Box(-1.0, 1.0, (3,)), gym.spaces.Box(-1.0, 1.0, (2,)), bin_basis=300)


def test_env_actions_are_bin_centres_inside_the_bounds():
    low = np.array([[-1.0, 0.0, 2.0], [-5.0, -0.5, 0.0]], np.float32)
    high = np.array([[1.0, 5.0, 2.5], [-4.0, 0.5, 100.0]], np.float32)
    policy = sharpen(TokenPolicy.from_spaces(gym.spaces.Box(-1.0, 1.0, (2,)), gym.spaces.Box(low, high), **SMALL))
    out = policy.act(np.zeros((64, 2), np.float32))
    assert out.actions.shape == out.env_actions.shape == (64, 2, 3)
    assert out.env_actions.dtype == np.float32
    assert np.all((out.actions >= 0) & (out.actions < 256))
    assert np.all((out.env_actions >= low) & (out.env_actions <= high))
    centres = low + (out.actions + 0.5) * (high - low) / 256
    np.testing.assert_allclose(out.env_actions, centres, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(policy.tokenize(out.env_actions), out.actions)  # centres round-trip
    np.testing.assert_array_equal(policy.tokenize(low), 0)
    np.testing.assert_array_equal(policy.tokenize(high), 255)
    np.testing.assert_array_equal(policy.tokenize(high + 10), 255)  # out of bounds: clipped


def test_action_chunks_from_action_chunk_wrapper():
    env = ActionChunk(MockEnv(dim=2), k=4)
    policy = TokenPolicy.from_spaces(env.observation_space, env.action_space, **SMALL)
    assert policy.num_tokens == 8
    out = policy.act(np.zeros((3, 2), np.float32))
    assert out.actions.shape == (3, 4, 2) and out.env_actions.shape == (3, 4, 2)
    _ = env.reset(seed=0)
    env.step(out.env_actions[0])
    logp, entropy, value = policy.evaluate(torch.zeros(3, 2), torch.from_numpy(out.actions))
    assert logp.shape == entropy.shape == value.shape == (3,)


def test_float_ids_are_accepted_and_bad_ids_rejected():
    policy = sharpen(TokenPolicy.from_spaces(gym.spaces.Box(-1.0, 1.0, (3,)), gym.spaces.Box(-1.0, 1.0, (2,)), **SMALL))
    obs = torch.randn(4, 3)
    ids = torch.from_numpy(policy.act(obs.numpy()).actions)
    for a, b in zip(policy.evaluate(obs, ids), policy.evaluate(obs, ids.float())):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="token ids"):
        policy.evaluate(obs, torch.full((4, 2), 256))


def test_seeding_makes_acting_reproducible():
    obs_space, act_space = gym.spaces.Box(-1.0, 1.0, (3,)), gym.spaces.Box(-1.0, 1.0, (4,))
    a, b = (TokenPolicy.from_spaces(obs_space, act_space, **SMALL, seed=7) for _ in range(2))
    c = TokenPolicy.from_spaces(obs_space, act_space, **SMALL, seed=8)
    for x, y in zip(a.state_dict().values(), b.state_dict().values()):
        assert torch.equal(x, y)
    obs = np.random.default_rng(0).standard_normal((16, 3)).astype(np.float32)
    for _ in range(3):
        ra, rb = a.act(obs), b.act(obs)
        np.testing.assert_array_equal(ra.actions, rb.actions)
        np.testing.assert_array_equal(ra.logprobs, rb.logprobs)
        np.testing.assert_array_equal(ra.values, rb.values)
    assert not np.array_equal(a.act(obs).actions, c.act(obs).actions)


@pytest.mark.parametrize("obs_space, act_space, match", [
    (gym.spaces.Box(-1.0, 1.0, (3,)), gym.spaces.Box(-np.inf, np.inf, (2,)), "Box"),
    (gym.spaces.Box(-1.0, 1.0, (3,)), gym.spaces.Box(np.float32([-1, -1]), np.float32([1, np.inf])), "Box"),
    (gym.spaces.Box(-1.0, 1.0, (3,)), gym.spaces.Discrete(5), "Discrete"),
    (gym.spaces.Box(-1.0, 1.0, (3,)), gym.spaces.Box(-1.0, 1.0, (2, 2, 2)), "Box"),
    # any observation the encoder reads is accepted (Discrete one-hot, any key, float images as
    # vectors); what it cannot read is named
    (gym.spaces.Dict({"depth": gym.spaces.Box(0, 255, (8, 8), np.uint8)}), gym.spaces.Box(-1.0, 1.0, (2,)),
     "'depth'.*2-D uint8"),
    (gym.spaces.Dict({"goal": gym.spaces.Text(8), "state": gym.spaces.Box(-1, 1, (3,))}),
     gym.spaces.Box(-1.0, 1.0, (2,)), "'goal', Text"),
])
def test_from_spaces_rejects_unsupported_spaces(obs_space, act_space, match):
    with pytest.raises(ValueError, match=match):
        TokenPolicy.from_spaces(obs_space, act_space, **SMALL)


def test_save_pretrained_round_trips_exactly(tmp_path):
    policy = sharpen(TokenPolicy.from_spaces(dict_space(), gym.spaces.Box(-2.0, 3.0, (2, 2)), **SMALL, seed=3))
    policy.update_obs_stats(torch_obs(dict_obs(32, seed=5)))
    policy.save_pretrained(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "model.safetensors"]

    loaded = TokenPolicy.from_pretrained(tmp_path / "ckpt")
    assert loaded.config == policy.config
    assert loaded.state_dict().keys() == policy.state_dict().keys()
    for k, v in policy.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    policy._gen = torch.Generator().manual_seed(3)  # a fresh stream, as the loaded policy has
    obs = dict_obs(8, seed=9)
    for _ in range(2):
        a, b = policy.act(obs), loaded.act(obs)
        np.testing.assert_array_equal(a.actions, b.actions)
        np.testing.assert_array_equal(a.env_actions, b.env_actions)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        np.testing.assert_array_equal(a.values, b.values)

    (tmp_path / "ckpt" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        TokenPolicy.from_pretrained(tmp_path / "ckpt")
    with pytest.raises(FileNotFoundError, match="config.json"):
        TokenPolicy.from_pretrained(tmp_path / "nowhere")


@pytest.mark.parametrize("cls", ["token", "flow"])
def test_a_config_without_a_key_the_policy_saves_is_refused_naming_it(tmp_path, cls):
    # the constructor's default would give the weights a setting they were not trained with
    import json

    from ebrl.policies.flow import FlowPolicy

    obs_space, act_space = gym.spaces.Box(-1.0, 1.0, (3,)), gym.spaces.Box(-1.0, 1.0, (2,))
    if cls == "token":
        saved, key = TokenPolicy.from_spaces(obs_space, act_space, **SMALL, bin_basis=0), "bin_basis"
    else:
        saved, key = FlowPolicy.from_spaces(obs_space, act_space, hidden=(16,), predict="velocity"), "predict"
    saved.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config[key]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"config.json lacks keys {type(saved).__name__} saves: \['{key}'\]"):
        type(saved).from_pretrained(tmp_path)


def test_dict_observations_with_pixels_state_and_instruction():
    policy = sharpen(TokenPolicy.from_spaces(dict_space(), gym.spaces.Box(-1.0, 1.0, (3,)), **SMALL, pixel_grid=3))
    assert policy.num_prefix == 1 + 9 + 1
    obs = dict_obs(4)
    out = policy.act(obs)
    assert out.actions.shape == out.env_actions.shape == (4, 3)
    assert out.logprobs.shape == out.values.shape == (4,)

    before = policy.obs_encoder.obs_mean.clone()
    policy.update_obs_stats(torch_obs(obs))
    assert not torch.equal(before, policy.obs_encoder.obs_mean)

    logp, entropy, value = policy.evaluate(torch_obs(obs), torch.from_numpy(out.actions))
    assert logp.shape == entropy.shape == value.shape == (4,)
    (logp.sum() + value.sum()).backward()
    for name in ("obs_encoder.images.0.conv.0.weight", "state_proj.weight", "instruction_proj.weight",
                 "token_embed.weight"):
        grad = dict(policy.named_parameters())[name].grad
        assert grad is not None and bool(grad.abs().sum() > 0), name

    # only some of the keys: pixels alone
    pixels_only = gym.spaces.Dict({"pixels": dict_space()["pixels"]})
    p2 = TokenPolicy.from_spaces(pixels_only, gym.spaces.Box(-1.0, 1.0, (2,)), **SMALL)
    assert p2.act({"pixels": obs["pixels"]}).actions.shape == (4, 2)
    p2.update_obs_stats({"pixels": torch.from_numpy(obs["pixels"])})  # no state: nothing to merge


def test_a_ppo_update_trains_it():
    policy = TokenPolicy.from_spaces(gym.spaces.Box(-1.0, 1.0, (3,)), gym.spaces.Box(-1.0, 1.0, (2,)), **SMALL)
    S, T = 2, 8
    obs = torch.randn(S, T, 3)
    out = policy.act(obs.reshape(-1, 3).numpy())
    acts = torch.from_numpy(out.actions).reshape(S, T, 2)
    assert acts.dtype == torch.int64
    no = torch.zeros(S, T, dtype=torch.bool)
    batch = Batch(obs, acts, torch.from_numpy(out.logprobs).reshape(S, T), torch.from_numpy(out.values).reshape(S, T),
                  torch.randn(S, T), no, no, torch.ones(S, T, dtype=torch.bool), torch.zeros(S, T, dtype=torch.long),
                  torch.randn(S, 3), torch.zeros(0, 3), torch.zeros(0, 2, dtype=torch.long))
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    metrics = PPO(minibatch_size=8).update(policy, batch)
    assert metrics["num_steps"] == 16.0 and metrics["minibatches"] == 8.0
    for k in ("policy_loss", "value_loss", "entropy", "approx_kl", "clipfrac"):
        assert np.isfinite(metrics[k]), k
    assert metrics["nonfinite_loss"] == 0.0
    changed = [k for k, v in policy.state_dict().items() if not torch.equal(v, before[k])]
    assert "token_head.weight" in changed and "blocks.0.attn.qkv.weight" in changed
    assert "obs_encoder.obs_mean" in changed


def test_end_to_end_training_run():
    env = MockEnv(dim=3, episode_len=8)
    policy = TokenPolicy.from_spaces(env.observation_space, env.action_space, d_model=32, layers=1, heads=2)
    res = ebrl.run_sync(ebrl.Trainer(
        lambda i: MockEnv(dim=3, episode_len=8), policy, PPO(minibatch_size=32),
        ebrl.RunConfig(num_envs=4, segment_len=16, total_env_steps=512,
                       sim={"backend": "thread", "num_threads": 2})))
    assert res.accounting_ok()
    assert res.env_steps >= 512 and res.updates >= 4
