"""SmolVLAPolicy (ebrl.policies.smolvla.policy): a LeRobot SmolVLA folder as an RL policy.

Every folder is a tiny random one from ``save_random_smolvla`` (LeRobot's own SmolVLA cannot run
beside this torch): the policy's ODE is checked against :meth:`SmolVLAModel.sample_actions` (itself
checked against LeRobot's definitions in tests/test_smolvla.py) on inputs prepared here as LeRobot
prepares them, with LeRobot's normalisation formulas written out. Sockets are refused.
"""

from __future__ import annotations

import json

import gymnasium as gym
import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from ebrl.algos import PPO
from ebrl.policies.base import acting_copy
from ebrl.policies.pi0.lerobot import merged_state_dict
from ebrl.policies.smolvla.lerobot import SmolVLAFolder, save_smolvla_lerobot
from ebrl.policies.smolvla.policy import SmolVLAPolicy
from ebrl.policies.smolvla.preprocess import pad_vector, prepare_images, resize_with_pad, tokenize_prompts
from ebrl.testing_smolvla import save_random_smolvla
from tests.policy_helpers import step_params
from tests.test_lerobot_pi0 import ACTIONS, SMALL, STATS, TASK  # the π0 folders' task, sizes and statistics
from tests.vla_helpers import expert_return, gap_closed, held_out_loss, ppo_grpo_keep_checkpoint, reach_demos

pytestmark = pytest.mark.usefixtures("hf_offline")  # conftest: sockets refused, the hub offline
torch.set_num_threads(1)



@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A folder with two cameras and one empty camera, its VLM directory and the model written."""
    root = tmp_path_factory.mktemp("smolvla-policy")
    model = save_random_smolvla(root / "policy", root / "vlm", empty_cameras=1, **STATS)
    return root / "policy", root / "vlm", model


def space(cameras=("camera1", "camera2")) -> gym.spaces.Dict:
    shapes = {"camera1": (16, 16, 3), "camera2": (12, 16, 3)}  # camera2 is resized with padding
    entries = {c: gym.spaces.Box(0, 255, shapes[c], np.uint8) for c in cameras}
    entries["state"] = gym.spaces.Box(-5.0, 5.0, (4,), np.float32)
    return gym.spaces.Dict(entries)


def observations(n, cameras=("camera1", "camera2"), seed=0) -> dict:
    rng = np.random.default_rng(seed)
    obs = {c: rng.integers(0, 256, (n, *space(cameras)[c].shape), dtype=np.uint8) for c in cameras}
    obs["state"] = (rng.standard_normal((n, 4)) * 2).astype(np.float32)
    return obs


def build(tiny, obs_space=None, **kw) -> SmolVLAPolicy:
    path, vlm, _ = tiny
    return SmolVLAPolicy.from_pretrained(path, obs_space or space(), ACTIONS, vlm=vlm, instruction=TASK,
                                         **{**SMALL, **kw})


def test_ode_acts_as_sample_actions_with_lerobots_normalisation(tiny):
    """Same noise, no injected noise: the env actions are SmolVLAModel.sample_actions on inputs
    prepared as LeRobot does (frames to [0, 1], resized with padding, to [-1, 1], the empty camera;
    the state MEAN_STD-normalised and padded; the prompt with its newline), cropped to the
    action's dims and un-normalised as LeRobot does."""
    path, vlm, model = tiny
    policy = build(tiny, method="ode")
    obs = observations(3)
    noise = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(1))
    out = policy.act(obs, noise=noise)
    assert out.actions.shape == (3, 4, 32) and out.env_actions.shape == (3, 3)

    s = {k: np.asarray(v, np.float64) for k, v in STATS.items()}
    state = (obs["state"].astype(np.float64) - s["state_mean"]) / (s["state_std"] + 1e-8)
    frames = {f"observation.images.{c}": torch.as_tensor(obs[c]).permute(0, 3, 1, 2).float() / 255
              for c in ("camera1", "camera2")}
    features = [*frames, "observation.images.empty_camera_0"]
    images, masks = prepare_images(frames, features, resize=(16, 16), empty_cameras=1)
    tokenizer = SmolVLAFolder.read(path).tokenizer(vlm)
    tokens, lang_masks = tokenize_prompts(tokenizer, [TASK] * 3, max_length=12)
    padded = pad_vector(torch.as_tensor(state, dtype=torch.float32), 8)
    with torch.no_grad():
        chunk = model.sample_actions(images, masks, tokens, lang_masks, padded, noise=noise).double().numpy()
    expected = np.clip(chunk[:, 0, :3] * s["action_std"] + s["action_mean"], -10, 10)
    np.testing.assert_allclose(out.env_actions, expected, atol=1e-5, rtol=0)
    assert np.abs(out.env_actions).max() > 1e-3


def test_two_cameras_and_an_empty_camera_are_fed_as_lerobot_prepares_them(tiny):
    """Two env cameras of different sizes fill their features (camera2 resized with padding), the
    config's empty camera is -1 and masked; an env without camera2 gets it as the empty one
    (empty_cameras=1 allows one), and the prompt is tokenized per row's instruction."""
    policy = build(tiny)
    obs = observations(2)
    inputs = policy.model_inputs(obs)
    assert [m.tolist() for m in inputs["img_masks"]] == [[True, True], [True, True], [False, False]]
    cam2 = torch.as_tensor(obs["camera2"]).permute(0, 3, 1, 2).float() / 255
    torch.testing.assert_close(inputs["images"][1], resize_with_pad(cam2, 16, 16, pad_value=0) * 2 - 1)
    assert (inputs["images"][1][:, :, :4] == -1).all() and (inputs["images"][2] == -1).all()
    assert inputs["lang_masks"].sum(1).tolist() == [6, 6] and inputs["state"].shape == (2, 8)
    one = build(tiny, space(("camera1",)))
    inputs = one.model_inputs(observations(2, ("camera1",)))
    assert len(inputs["images"]) == 2 and not inputs["img_masks"][1].any()
    assert one.act(observations(2, ("camera1",))).env_actions.shape == (2, 3)
    described = [d["key"] for d in policy.describe_inputs()]
    assert described == ["camera1", "camera2", "state"]


def test_lora_ppo_and_grpo_leave_the_checkpoint_bit_identical(tiny):
    policy = build(tiny, lora_rank=4)
    trainable = {k for k, p in policy.named_parameters() if p.requires_grad}
    assert any("lora_" in k for k in trainable) and {"noise_head.0.weight", "value_head.0.weight"} <= trainable
    assert not any("vision_model" in k for k in trainable)  # LoRA on the text layers and the expert only
    assert any(".lm_expert." in k and "lora_" in k for k in trainable)
    assert any(".text_model.layers." in k and "lora_" in k for k in trainable)
    twin = acting_copy(policy)

    ppo_grpo_keep_checkpoint(policy, observations)  # the checkpoint: bit-identical
    twin.load_trainable_state_dict(policy.trainable_state_dict())  # what weight publication does
    obs, noise = observations(2, seed=9), torch.randn(2, 4, 8)
    np.testing.assert_array_equal(twin.act(obs, noise=noise).values, policy.act(obs, noise=noise).values)
    feats = policy.value_features(obs)
    torch.testing.assert_close(policy.value_from_features(feats), policy.value(obs))


@pytest.mark.parametrize("method", ["flow-noise", "flow-sde"])
def test_evaluate_scores_the_stored_chain_as_act_sampled_it(tiny, method):
    policy = build(tiny, method=method, execute=2)
    obs = observations(3)
    out = policy.act(obs)
    assert out.env_actions.shape == (3, 2, 3) and policy.expected_spaces().action.shape == (2, 3)
    logp, entropy, value = policy.evaluate(obs, torch.from_numpy(out.actions))
    np.testing.assert_allclose(logp.detach().numpy(), out.logprobs, atol=1e-4)
    assert entropy.shape == value.shape == (3,)
    mean, sigma = step_params(policy, obs, torch.from_numpy(out.actions[:, 0]), 0)
    assert mean.shape == (3, 32) and sigma.shape == (3, 6)


def test_gradient_checkpointing_gives_the_same_gradients_and_bf16_runs(tiny):
    obs = observations(2)
    grads = []
    for checkpointing in (False, True):
        policy = build(tiny, lora_rank=2, gradient_checkpointing=checkpointing)
        out = policy.act(obs)
        logp, _, value = policy.evaluate(obs, torch.from_numpy(out.actions))
        (logp.sum() + value.sum()).backward()
        grads.append({k: p.grad.clone() for k, p in policy.named_parameters() if p.grad is not None})
    assert set(grads[0]) == set(grads[1]) and any("lora_B" in k for k in grads[0])
    for k in grads[0]:
        torch.testing.assert_close(grads[0][k], grads[1][k], atol=1e-6, rtol=1e-5)
    half = build(tiny, dtype="bfloat16", lora_rank=2)
    assert half.hf_model.vlm_with_expert.lm_expert.layers[0].mlp.gate_proj.weight.dtype == torch.bfloat16
    assert half.hf_model.action_out_proj.weight.dtype == torch.float32
    out = half.act(obs)
    logp, _, _ = half.evaluate(obs, torch.from_numpy(out.actions))
    assert logp.dtype == torch.float32 and np.isfinite(out.env_actions).all()
    np.testing.assert_allclose(logp.detach().numpy(), out.logprobs, atol=1e-2)


def test_sft_on_demonstrations_lowers_the_held_out_flow_loss(tmp_path):
    """ebrl.sft.sft on mock/reach demonstrations (no camera: the prefix is the prompt and the
    state), LoRA: the held-out flow loss falls."""
    pytest.importorskip("pyarrow")
    from ebrl.sft import SFTConfig, sft

    demos, env = reach_demos(tmp_path)
    save_random_smolvla(tmp_path / "policy", tmp_path / "vlm", camera_names=(), state_dim=4, action_dim=2,
                        action_std=1.0)
    policy = SmolVLAPolicy.from_pretrained(tmp_path / "policy", env.observation_space, env.action_space,
                                           vlm=tmp_path / "vlm", instruction=env.instructions(), lora_rank=8, **SMALL)
    held_out, _ = held_out_loss(policy, demos, env)
    before = held_out()
    out = sft(policy, demos.select([0, 1, 2]), env.observation_space, env.action_space,
              SFTConfig(epochs=10, lr=1e-2, minibatch_size=32, val_fraction=0.0))
    assert out["train_loss"][-1] < out["train_loss"][0]
    assert held_out() < 0.5 * before, (before, held_out())


def test_sft_train_eval_and_export_from_the_command_line(tmp_path, capsys):
    """``ebrl sft`` with ``policy.kind=hf``, ``policy.path`` a SmolVLA folder and ``policy.vlm``;
    ``ebrl train --set policy.init=SFT`` starts from its weights; ``ebrl eval`` runs it; ``ebrl
    export --format lerobot`` writes a LeRobot folder (the source's config and pipelines, the
    weights LoRA merged) that loads back bit for bit."""
    from ebrl.cli import main
    from ebrl.runs import build_spec, build_trainer, load_run
    from ebrl.testing import InstructedReach

    path, vlm = tmp_path / "policy", tmp_path / "vlm"
    save_random_smolvla(path, vlm, camera_names=(), state_dim=4, action_dim=2)
    assert main(["demos", "collect", "mock/reach", "--policy", "scripted", "--episodes", "2",
                 "--out", str(tmp_path / "demos")]) == 0
    small = ["--set", "policy.noise_hidden=[16]", "--set", "policy.value_hidden=[16]"]
    assert main(["sft", str(tmp_path / "demos"), "--set", "policy.kind=hf", "--set", f"policy.path={path}",
                 "--set", f"policy.vlm={vlm}", "--set", "policy.execute=2", "--set", "policy.lora_rank=4",
                 "--set", "sft.epochs=1", *small, "--out", str(tmp_path / "sft")]) == 0
    _, trainer = load_run(tmp_path / "sft")
    policy = trainer.policy
    assert isinstance(policy, SmolVLAPolicy) and policy.expected_spaces().action.shape == (2, 2)
    assert policy.texts == InstructedReach().instructions()
    rl = build_trainer(build_spec(None, ["env=mock/reach", f"policy.init={tmp_path / 'sft'}"])).policy
    loaded = rl.trainable_state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in policy.trainable_state_dict().items())
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "sft"), "--episodes", "1", "--json"]) == 0
    assert "mean_return" in capsys.readouterr().out

    merged = merged_state_dict(policy)
    assert main(["export", str(tmp_path / "sft"), "--format", "lerobot", "--out", str(tmp_path / "out")]) == 0
    out = tmp_path / "out"
    for name in ("config.json", "policy_preprocessor.json", "policy_postprocessor.json"):
        assert (out / name).read_text() == (path / name).read_text(), name
    reach = gym.spaces.Dict({"state": gym.spaces.Box(-1, 1, (4,), np.float32)})
    reloaded = SmolVLAPolicy.from_pretrained(out, reach, gym.spaces.Box(-1, 1, (2,), np.float32), vlm=vlm,
                                             instruction="reach the red target", **SMALL)
    state = reloaded.hf_model.state_dict()
    assert set(state) == set(merged) and all(torch.equal(state[k], merged[k]) for k in merged)
    assert any(not torch.equal(merged[k], v) for k, v in SmolVLAFolder.read(path).load_model(vlm).state_dict().items()
               if "q_proj" in k)  # the SFT's adapters, merged
    assert main(["export", str(tmp_path / "sft"), "--format", "transformers", "--out", str(tmp_path / "hf")]) == 2
    assert "LeRobot's layout only" in capsys.readouterr().err


def test_the_registry_routes_a_smolvla_folder_and_a_missing_vlm_is_one_clear_error(tiny, tmp_path):
    from ebrl.policies import from_pretrained

    path, vlm, _ = tiny
    assert isinstance(from_pretrained(path, space(), ACTIONS, vlm=vlm, instruction=TASK, **SMALL), SmolVLAPolicy)
    assert json.loads((path / "config.json").read_text())["type"] == "smolvla"
    with pytest.raises(FileNotFoundError, match=r"built on 'HuggingFaceTB/SmolVLM2-500M-Video-Instruct'.*vlm=DIR"):
        from_pretrained(path, space(), ACTIONS, instruction=TASK)
    with pytest.raises(FileNotFoundError, match="has no config.json and no tokenizer"):
        SmolVLAPolicy.from_pretrained(path, space(), ACTIONS, vlm=tmp_path, instruction=TASK)
    with pytest.raises(ValueError, match="no camera of the checkpoint is in the env"):
        build(tiny, gym.spaces.Dict({"state": gym.spaces.Box(-1, 1, (4,), np.float32)}))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        save_smolvla_lerobot(type("P", (), {"config": {"base_path": str(tmp_path / "gone")}})(), tmp_path / "x")


REACH_FLOOR = 0.15


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rl_from_a_tiny_smolvla_beats_its_untrained_copy_on_an_instructed_reach(tmp_path):
    """PPO through Flow-SDE on a tiny random SmolVLA (LoRA rank 4, 2 of each 4-action chunk
    executed, no camera) on the instructed reach, under ``ebrl.run`` in virtual time on one torch
    thread, seeded: within 6,000 decisions it closes at least ``REACH_FLOOR`` of the return gap
    between its untrained copy and the scripted expert, with its mode and with its samples, on 32
    reset seeds it never trained on (π0's test in tests/test_pi0.py, shorter)."""
    import copy

    import ebrl
    from ebrl.testing import InstructedReach, run_virtual, torch_threads

    def make(i=0):
        return InstructedReach(tasks=2, dim=2, episode_len=16)

    env = make()
    save_random_smolvla(tmp_path / "policy", tmp_path / "vlm", camera_names=(), state_dim=4, action_dim=2,
                        action_std=1.0)
    best = expert_return(make())
    with torch_threads(1):
        policy = SmolVLAPolicy.from_pretrained(tmp_path / "policy", env.observation_space, env.action_space,
                                               vlm=tmp_path / "vlm", instruction=env.instructions(), execute=2,
                                               lora_rank=4, method="flow-sde", noise_level=1.0, denoise_steps=2,
                                               noise_hidden=(32,), value_hidden=(64,), seed=0)
        untrained = copy.deepcopy(policy)
        res = run_virtual(ebrl.Trainer(make, policy, PPO(minibatch_size=64, update_epochs=4, seed=0),
                                       ebrl.RunConfig(num_envs=8, segment_len=16, total_env_steps=6_000, seed=0)))
        assert res.accounting_ok() and res.env_steps == 6_000
        closed = gap_closed(untrained, policy, make, best)
    print(f"SmolVLA instructed reach, share of the gap closed: mode {closed[True][0]:.4f}, "
          f"samples {closed[False][0]:.4f}")
    for deterministic, (share, before, after) in closed.items():
        assert share >= REACH_FLOOR, (deterministic, before, after, best)
