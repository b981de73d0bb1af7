"""FlowPolicy: the Flow-Noise chain likelihood, chunk shapes, PPO training end to end, files."""

import gymnasium as gym
import numpy as np
import pytest
import torch

import ebrl
from ebrl.algos import PPO, Batch
from ebrl.envs.chunks import ActionChunk
from ebrl.policies.flow import FlowPolicy
from ebrl.testing import MockEnv
from tests.policy_helpers import step_params

OBS = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
CHUNK = gym.spaces.Box(-2.0, 1.0, (4, 2), np.float32)


def small(obs_space=OBS, act_space=CHUNK, **kw) -> FlowPolicy:
    kw = {"hidden": (32, 32), "noise_hidden": (16,), "critic_hidden": (32,), **kw}
    return FlowPolicy.from_spaces(obs_space, act_space, **kw)


def obs_batch(b: int, dim: int = 3, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (b, dim)).astype(np.float32)


def test_logprobs_match_evaluate_and_a_hand_computation():
    policy = small(denoise_steps=3, sigma_max=0.9, init_sigma=0.4)
    obs = obs_batch(16)
    policy.update_obs_stats(torch.from_numpy(obs))  # non-trivial normalisation on both paths
    out = policy.act(obs)
    logp, entropy, value = policy.evaluate(torch.from_numpy(obs), torch.from_numpy(out.actions))
    np.testing.assert_allclose(out.logprobs, logp.detach().numpy(), atol=1e-4)
    np.testing.assert_allclose(out.values, value.detach().numpy(), atol=1e-5)
    assert logp.requires_grad and torch.isfinite(entropy).all()

    # by hand, in float64, one sample at a time: N(x_0; 0, I) times every step's Gaussian
    chain = torch.from_numpy(out.actions).double()
    for i in range(2):
        o = torch.from_numpy(obs[i:i + 1])
        total = torch.distributions.Normal(0.0, 1.0).log_prob(chain[i, 0]).sum()
        ent = torch.distributions.Normal(0.0, 1.0).entropy() * chain.shape[-1]
        for k in range(3):
            with torch.no_grad():
                mean, sigma = step_params(policy, o, chain[i:i + 1, k].float(), k)
            dist = torch.distributions.Normal(mean.double()[0], sigma.double()[0])
            total = total + dist.log_prob(chain[i, k + 1]).sum()
            ent = ent + dist.entropy().sum()
        assert float(total) == pytest.approx(float(out.logprobs[i]), abs=1e-4)
        assert float(ent) == pytest.approx(float(entropy[i].detach()), abs=1e-4)


def test_chain_is_euler_plus_bounded_noise_and_ends_in_the_env_action():
    policy = small(denoise_steps=4)
    obs = obs_batch(8)
    out = policy.act(obs)
    chain = torch.from_numpy(out.actions)
    with torch.no_grad():
        mean, sigma = step_params(policy, torch.from_numpy(obs), chain[:, 0], 0)
    assert ((sigma >= 0.01) & (sigma <= 1.0)).all()
    assert torch.allclose(sigma, torch.full_like(sigma, 0.5), atol=0.05)  # starts near init_sigma
    assert ((chain[:, 1] - mean).abs() / sigma).max() < 6.0  # x_1 ~ N(mean_0, sigma_0^2)
    x_n = np.clip(out.actions[:, -1].reshape(8, 4, 2), -1, 1)
    np.testing.assert_allclose(out.env_actions, -2.0 + (x_n + 1) / 2 * 3.0, atol=1e-6)


@pytest.mark.parametrize("predict", ["action", "velocity"])
def test_each_step_mean_follows_the_prediction(predict):
    # "action": the network predicts the final chunk x1_hat and the velocity is
    # (x1_hat - x) / (1 - tau), so step k moves 1 / (N - k) of the way and the last lands on it;
    # "velocity": the network's output is the velocity itself
    policy = small(denoise_steps=4, predict=predict)
    obs = torch.from_numpy(obs_batch(6))
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    feat = policy._features(obs)
    for k in range(4):
        tau = torch.full((6,), k / 4)
        with torch.no_grad():
            out = policy.velocity(torch.cat([x, feat, policy._time_embed(tau)], -1))
            mean, _ = step_params(policy, obs, x, k)
        expected = x + (out - x) / (4 - k) if predict == "action" else x + out / 4
        assert torch.allclose(mean, expected, atol=1e-6)
    if predict == "action":
        assert torch.allclose(mean, out, atol=1e-6)  # k = N - 1: the mean is the prediction
    with pytest.raises(ValueError, match="predict="):
        small(predict="noise")


def test_shapes_and_bounds():
    out = small().act(obs_batch(5))
    assert out.actions.shape == (5, 5, 8) and out.actions.dtype == np.float32  # [B, N + 1, K * A]
    assert out.env_actions.shape == (5, 4, 2) and CHUNK.contains(out.env_actions[0])
    assert out.env_actions.min() >= -2.0 and out.env_actions.max() <= 1.0
    assert out.logprobs.shape == out.values.shape == (5,) and out.logprobs.dtype == np.float32
    # K = 1 on a plain Box(A)
    out = small(act_space=gym.spaces.Box(-1.0, 1.0, (3,)), denoise_steps=2).act(obs_batch(6))
    assert out.actions.shape == (6, 3, 3) and out.env_actions.shape == (6, 3)


def test_dict_observations_concatenate_state_and_instruction():
    space = gym.spaces.Dict({"state": gym.spaces.Box(-np.inf, np.inf, (3,)),
                             "instruction": gym.spaces.Box(-1.0, 1.0, (5,)),
                             "pixels": gym.spaces.Box(0, 255, (8, 8, 3), np.uint8)})
    # the vectors only (by default the camera would get a CNN too: tests/test_obs_encoder.py)
    policy = small(space, state_keys=["state", "instruction"], image_keys=[])
    assert policy.obs_dim == 8 and [e.key for e in policy.obs_layout.entries] == ["state", "instruction"]
    obs = {"state": obs_batch(4), "instruction": obs_batch(4, 5, 1), "pixels": np.zeros((4, 8, 8, 3), np.uint8)}
    out = policy.act(obs)
    logp, _, _ = policy.evaluate({k: torch.from_numpy(v) for k, v in obs.items()}, torch.from_numpy(out.actions))
    np.testing.assert_allclose(out.logprobs, logp.detach().numpy(), atol=1e-4)


def test_chunks_step_the_inner_env_k_times_end_to_end(no_leaks):
    inner: list[MockEnv] = []

    def env_fn(i):
        env = MockEnv(dim=2, episode_len=40)  # a multiple of 4: no chunk is cut short
        inner.append(env)
        return ActionChunk(env, k=4)

    probe = ActionChunk(MockEnv(dim=2, episode_len=40), k=4)
    policy = small(probe.observation_space, probe.action_space)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    res = ebrl.run_sync(ebrl.Trainer(env_fn, policy, PPO(minibatch_size=32), ebrl.RunConfig(
        num_envs=4, segment_len=8, total_env_steps=256, sim={"backend": "thread", "num_threads": 2})))
    assert res.accounting_ok() and res.env_steps >= 256 and res.trained > 0
    assert sum(env.steps for env in inner) == 4 * res.env_steps
    assert any(not torch.equal(before[k], v) for k, v in policy.state_dict().items())


def make_batch(policy: FlowPolicy, S: int = 2, T: int = 8) -> Batch:
    obs = torch.from_numpy(obs_batch(S * T)).reshape(S, T, 3)
    out = policy.act(obs.reshape(-1, 3).numpy())
    no = torch.zeros(S, T, dtype=torch.bool)
    return Batch(obs, torch.from_numpy(out.actions).reshape(S, T, *out.actions.shape[1:]),
                 torch.from_numpy(out.logprobs).reshape(S, T), torch.from_numpy(out.values).reshape(S, T),
                 torch.randn(S, T, generator=torch.Generator().manual_seed(0)), no, no,
                 torch.ones(S, T, dtype=torch.bool), torch.zeros(S, T, dtype=torch.long),
                 torch.randn(S, 3), torch.zeros(0, 3), torch.zeros(0, 2, dtype=torch.long))


def test_ppo_update_is_finite_and_changes_the_weights():
    policy = small()
    before = {k: v.clone() for k, v in policy.named_parameters()}
    metrics = PPO(minibatch_size=8).update(policy, make_batch(policy))
    assert metrics["num_steps"] == 16.0 and metrics["nonfinite_loss"] == 0.0
    for k in ("policy_loss", "value_loss", "entropy", "approx_kl", "clipfrac"):
        assert np.isfinite(metrics[k]), k
    changed = {k for k, v in policy.named_parameters() if not torch.equal(before[k], v)}
    assert any(k.startswith("velocity") for k in changed) and any(k.startswith("noise") for k in changed)


@pytest.mark.parametrize("predict", ["action", "velocity"])
def test_flow_matching_loss_trains_the_sampler_onto_the_demonstrations(predict):
    torch.manual_seed(0)
    # little injected noise, so that the sampler's chunks show what the velocity field learnt
    policy = small(hidden=(64, 64), predict=predict, sigma_min=0.001, init_sigma=0.01, sigma_max=0.02)
    obs = torch.from_numpy(obs_batch(64))
    chunks = (obs[:, :2, None] * torch.linspace(0.2, 1.0, 4)).transpose(1, 2).clamp(-1, 1)  # [64, 4, 2]
    chunks = -2.0 + (chunks + 1) / 2 * 3.0  # into the Box [-2, 1]
    error_before = np.abs(policy.act(obs.numpy()).env_actions - chunks.numpy()).mean()
    opt = torch.optim.Adam(policy.velocity.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(300):
        loss = policy.flow_matching_loss(obs, chunks, generator=gen)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10])
    error_after = np.abs(policy.act(obs.numpy()).env_actions - chunks.numpy()).mean()
    assert error_after < 0.5 * error_before, (error_before, error_after)


def test_seeding_is_reproducible():
    obs = obs_batch(4)
    a, b, c = small(seed=3).act(obs), small(seed=3).act(obs), small(seed=4).act(obs)
    np.testing.assert_array_equal(a.actions, b.actions)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert not np.array_equal(a.actions, c.actions)


def test_save_and_load_round_trip(tmp_path):
    policy = small(denoise_steps=3)
    policy.update_obs_stats(torch.from_numpy(obs_batch(32)))
    policy.save_pretrained(tmp_path / "flow")
    assert {p.name for p in (tmp_path / "flow").iterdir()} == {"model.safetensors", "config.json"}
    loaded = FlowPolicy.from_pretrained(tmp_path / "flow")
    assert loaded.denoise_steps == 3 and loaded.chunk_shape == (4, 2)
    for k, v in policy.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    obs = obs_batch(4)
    np.testing.assert_array_equal(policy.act(obs).actions, loaded.act(obs).actions)  # same seed, same stream
    (tmp_path / "flow" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        FlowPolicy.from_pretrained(tmp_path / "flow")
    with pytest.raises(FileNotFoundError, match="config.json"):
        FlowPolicy.from_pretrained(tmp_path / "nowhere")


def test_bad_spaces_raise():
    with pytest.raises(ValueError, match="finite action bounds.*Box"):
        FlowPolicy.from_spaces(OBS, gym.spaces.Box(-np.inf, np.inf, (4, 2)))
    with pytest.raises(ValueError, match="Discrete"):
        FlowPolicy.from_spaces(OBS, gym.spaces.Discrete(3))
    with pytest.raises(ValueError, match="Box action space"):
        FlowPolicy.from_spaces(OBS, gym.spaces.Box(-1, 1, (2, 2, 2)))
    with pytest.raises(ValueError, match="8x8 px.*too small"):  # a camera gets a CNN, which needs more pixels
        FlowPolicy.from_spaces(gym.spaces.Box(0, 255, (8, 8, 3), np.uint8), CHUNK)
    with pytest.raises(ValueError, match="'goal', Graph"):  # what no policy input reads is named
        FlowPolicy.from_spaces(gym.spaces.Dict({"state": OBS, "goal": gym.spaces.Graph(
            gym.spaces.Box(0, 1, (2,)), None)}), CHUNK)
    with pytest.raises(ValueError, match="sigma_min"):
        small(sigma_min=0.5, sigma_max=0.4)
