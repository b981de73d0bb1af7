"""PI0Policy: a user's π0 / π0.5 checkpoint (transformers' own model) as an EBRL policy.

Every checkpoint here is a tiny random PI0/PI05ForConditionalGeneration that
:func:`ebrl.testing.save_random_pi0` builds from configs and saves with a word-level tokenizer and
the processor's ``processor_config.json``: nothing is downloaded, and every test runs with
sockets refused and ``HF_HUB_OFFLINE=1``. The reference for what the model is fed is
transformers' own ``PI0Processor`` / ``PI05Processor``, with the image processor on its PIL
backend (its torchvision backend cannot import here).
"""

from __future__ import annotations

import json
import shutil

import gymnasium as gym
import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("PIL")

from ebrl.algos import PPO
from ebrl.policies.base import acting_copy
from ebrl.policies.hf_backbone import pil_pi0_image_processor
from ebrl.policies.pi0.policy import PI0Policy
from ebrl.policies.pi0.preprocessing import ImageSettings, preprocess_images
from ebrl.testing import save_random_pi0
from tests.policy_helpers import step_params
from tests.vla_helpers import expert_return, gap_closed, held_out_loss, ppo_grpo_keep_checkpoint, reach_demos

pytestmark = pytest.mark.usefixtures("hf_offline")  # conftest: sockets refused, the hub offline
torch.set_num_threads(1)

TASKS = ["pick up the red block", "open the drawer and reach the target"]
ACTIONS = gym.spaces.Box(-10.0, 10.0, (2, 3), np.float32)  # execute 2 of the chunk of 4, 3 of 8 dims
SMALL = {"noise_hidden": (16,), "value_hidden": (16,)}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    out = {}
    # weights at 0.3: a prefix that moves the actions visibly; π0.5 with quantile statistics
    for kind in ("pi0", "pi05"):
        out[kind] = tmp_path_factory.mktemp(kind)
        save_random_pi0(out[kind], kind=kind, state_dim=4, action_dim=3, chunk_size=4, initializer_range=0.3,
                        action_mean=[0.1, -0.2, 0.3], action_std=[0.5, 1.0, 2.0], quantile_stats=kind == "pi05")
    return out


def space(cameras=((16, 16),), n_tasks=2) -> gym.spaces.Dict:
    entries = {f"cam{i}": gym.spaces.Box(0, 255, (h, w, 3), np.uint8) for i, (h, w) in enumerate(cameras)}
    entries.update(state=gym.spaces.Box(-5.0, 5.0, (4,), np.float32), instruction=gym.spaces.Discrete(n_tasks))
    return gym.spaces.Dict(entries)


def observations(n, cameras=((16, 16),), seed=0) -> dict:
    rng = np.random.default_rng(seed)
    obs = {f"cam{i}": rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8) for i, (h, w) in enumerate(cameras)}
    obs.update(state=rng.standard_normal((n, 4)).astype(np.float32), instruction=np.arange(n) % 2)
    return obs


def torch_obs(obs: dict) -> dict:
    return {k: torch.as_tensor(v) for k, v in obs.items()}


def build(path, obs_space=None, actions=ACTIONS, **kw) -> PI0Policy:
    return PI0Policy.from_pretrained(path, obs_space or space(), actions, instruction=TASKS, **{**SMALL, **kw})


def processor(path):
    """transformers' own processor for the checkpoint, its image processor on the PIL backend."""
    from transformers import AutoTokenizer, PI0Processor, PI05Processor

    config = json.loads((path / "processor_config.json").read_text())
    images = pil_pi0_image_processor(**{k: v for k, v in config.pop("image_processor").items()
                                        if k != "image_processor_type"})
    cls = PI0Processor if config.pop("processor_class") == "PI0Processor" else PI05Processor
    return cls(image_processor=images, tokenizer=AutoTokenizer.from_pretrained(path), **config)


def processed(path, obs, cameras):
    texts = [TASKS[i] for i in obs["instruction"]]
    images = [[obs[f"cam{c}"][r] for c in range(len(cameras))] for r in range(len(texts))]
    return processor(path)(images=images, text=texts, state=obs["state"])


def unnormalised(path, chunk: np.ndarray) -> np.ndarray:
    """The executed block of model chunks in the env's units (the inverse of the processor's ``normalize``)."""
    config = json.loads((path / "processor_config.json").read_text())
    if config.get("actions_q01") is not None:
        q01, q99 = np.asarray(config["actions_q01"]), np.asarray(config["actions_q99"])
        return (chunk[:, :2, :3] + 1) / 2 * (q99 - q01) + q01
    return chunk[:, :2, :3] * (np.asarray(config["actions_std"]) + 1e-8) + np.asarray(config["actions_mean"])


@pytest.mark.parametrize("kind", ["pi0", "pi05"])
def test_ode_acts_as_sample_actions_on_what_the_processor_gives(kind, dirs):
    """Same noise, no injected noise: EBRL's env actions are sample_actions' chunk on the
    processor's own inputs, un-normalised and cropped (cameras the vision tower's size: no resize)."""
    from transformers import PI0ForConditionalGeneration, PI05ForConditionalGeneration

    policy = build(dirs[kind], method="ode")
    obs = observations(4)
    noise = torch.randn(4, 4, 8, generator=torch.Generator().manual_seed(1))
    out = policy.act(obs, noise=noise)
    inputs = processed(dirs[kind], obs, [0])
    mine = policy.model_inputs(obs)
    assert set(mine) == set(inputs)
    for key, value in inputs.items():  # the very tensors the processor gives
        assert torch.equal(mine[key].to(value.dtype), value), key
    model = (PI0ForConditionalGeneration if kind == "pi0" else PI05ForConditionalGeneration).from_pretrained(
        dirs[kind], local_files_only=True)
    chunk = model.sample_actions(**inputs, noise=noise).numpy()
    np.testing.assert_allclose(out.env_actions, unnormalised(dirs[kind], chunk), atol=1e-5, rtol=0)
    np.testing.assert_allclose(out.actions[:, -1], chunk.reshape(4, -1), atol=1e-5, rtol=0)
    assert out.actions.shape == (4, 3 + 1, 4 * 8) and out.env_actions.shape == (4, 2, 3)
    # the prefix matters: the other task gives other actions
    swapped = policy.act({**obs, "instruction": 1 - obs["instruction"]}, noise=noise)
    assert np.abs(swapped.env_actions - out.env_actions).max() > 1e-3


def test_images_are_preprocessed_as_the_image_processor_defines():
    """The torch resize/rescale/normalise/pad against PI0ImageProcessor on the PIL backend: at
    most two uint8 levels apart (PIL resamples in fixed point), almost everywhere equal."""
    rng = np.random.default_rng(0)
    for (h, w), size in (((20, 30), 16), ((16, 16), 16), ((12, 40), 16), ((100, 80), 224), ((480, 640), 224)):
        reference = pil_pi0_image_processor(size={"max_height": size, "max_width": size},
                                            pad_size={"height": size, "width": size})
        frames = rng.integers(0, 256, (3, h, w, 3), dtype=np.uint8)
        expected = reference(list(frames), return_tensors="pt")["pixel_values"]
        got = preprocess_images(torch.from_numpy(frames).permute(0, 3, 1, 2), ImageSettings.from_config(
            reference.to_dict()))
        assert got.shape == expected.shape == (3, 3, size, size)
        levels = (got - expected).abs() * 255 / 2  # normalised with mean = std = 0.5
        assert float(levels.max()) <= 2.0 + 1e-3, (h, w)
        assert float((levels > 0.5).float().mean()) < 0.01, (h, w)
        if (h, w) == (size, size):
            assert torch.equal(got, expected)


@pytest.mark.parametrize("kind", ["pi0", "pi05"])
def test_two_cameras_of_different_sizes_and_an_instruction_index(kind, dirs):
    cameras = ((16, 16), (20, 12))
    policy = build(dirs[kind], space(cameras), method="flow-noise")
    obs = observations(3, cameras, seed=2)
    inputs, mine = processed(dirs[kind], obs, cameras), policy.model_inputs(obs)
    for key in ("input_ids", "attention_mask", "pixel_attention_mask", *(("state",) if kind == "pi0" else ())):
        assert torch.equal(mine[key].to(inputs[key].dtype), inputs[key]), key
    assert mine["pixel_values"].shape == inputs["pixel_values"].shape == (3, 2, 3, 16, 16)
    assert float((mine["pixel_values"] - inputs["pixel_values"]).abs().max()) <= 4 / 255 + 1e-6
    out = policy.act(obs)
    assert out.actions.shape == (3, 4, 32) and out.env_actions.shape == (3, 2, 3)
    assert out.logprobs.shape == out.values.shape == (3,) and np.isfinite(out.logprobs).all()
    inputs_described = {d["key"]: d for d in policy.describe_inputs()}
    assert set(inputs_described) == {"cam0", "cam1", "state", "instruction"}
    assert inputs_described["instruction"]["as"] == "instruction index"


def test_actions_are_unnormalised_cropped_and_clipped_into_the_box(dirs):
    box = gym.spaces.Box(np.array([-0.2, -1.0, 0.0], np.float32), np.array([0.3, 1.0, 5.0], np.float32))
    policy = build(dirs["pi0"], actions=box, method="flow-sde", noise_level=0.7)  # (A,): execute 1
    out = policy.act(observations(16, seed=3))
    assert out.env_actions.shape == (16, 3) and policy.expected_spaces().action.shape == (3,)
    assert all(box.contains(a) for a in out.env_actions)
    raw = unnormalised(dirs["pi0"], out.actions[:, -1].reshape(16, 4, 8))[:, 0]
    np.testing.assert_allclose(out.env_actions, np.clip(raw, box.low, box.high), atol=1e-6)
    assert (raw != out.env_actions).any()  # some were clipped
    # execute=2 on a Box (A,): the policy acts in chunks of two, which ebrl.run executes with ActionChunk
    chunked = build(dirs["pi0"], actions=box, execute=2)
    assert chunked.expected_spaces().action.shape == (2, 3) and chunked.act(observations(2)).env_actions.shape == (2, 2, 3)


@pytest.mark.parametrize("method", ["flow-noise", "flow-sde"])
@pytest.mark.parametrize("kind", ["pi0", "pi05"])
def test_evaluate_gives_acts_logprobs_for_the_stored_chain(kind, method, dirs):
    policy = build(dirs[kind], method=method, denoise_steps=3, noise_level=0.5)
    obs = observations(5, seed=4)
    out = policy.act(obs)
    logp, entropy, value = policy.evaluate(torch_obs(obs), torch.from_numpy(out.actions))
    assert logp.requires_grad and bool(torch.isfinite(entropy).all())
    np.testing.assert_allclose(logp.detach().numpy(), out.logprobs, atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(value.detach().numpy(), out.values, atol=1e-5)
    np.testing.assert_allclose(policy.value(torch_obs(obs)).detach().numpy(), out.values, atol=1e-5)
    # by hand, float64, for one row: N(x_0; 0, I) and each step's Gaussian on the executed block
    chain = torch.from_numpy(out.actions[:1]).double().reshape(1, 4, 4, 8)
    row = {k: v[:1] for k, v in torch_obs(obs).items()}
    ode = build(dirs[kind], method="ode", denoise_steps=3)  # the same model: its Euler step gives the velocity
    total = torch.distributions.Normal(0.0, 1.0).log_prob(chain[0, 0, :2, :3]).sum()
    for k in range(3):
        with torch.no_grad():
            mean, sigma = step_params(policy, row, chain[:, k].float().reshape(1, -1), k)
        block = mean.double().reshape(4, 8)[:2, :3]
        unexecuted = torch.ones(4, 8, dtype=torch.bool)
        unexecuted[:2, :3] = False  # the rest of the chunk follows the ODE: exactly the mean
        assert torch.allclose(chain[0, k + 1][unexecuted], mean.double().reshape(4, 8)[unexecuted], atol=1e-6)
        if method == "flow-sde":  # sigma_t = a sqrt(t / (1 - t)), t = 1 with t_1 below; std sqrt(1/N) sigma_t
            t, below, delta = 1 - k / 3, (2 / 3 if k == 0 else 1 - k / 3), 1 / 3
            sigma_t = 0.5 * (t / (1 - below)) ** 0.5
            assert torch.allclose(sigma, torch.full_like(sigma, delta ** 0.5 * sigma_t))
            # RLinf's sample_mean_var_val: x0_pred (1 - t + delta) + x1_pred (t - delta - sigma_t^2 delta / (2 t))
            with torch.no_grad():
                euler = step_params(ode, row, chain[:, k].float().reshape(1, -1), k)[0].double().reshape(4, 8)
            x = chain[0, k]
            v = (euler - x) / -delta
            x0_pred, x1_pred = x - v * t, x + v * (1 - t)
            expected = x0_pred * (1 - t + delta) + x1_pred * (t - delta - sigma_t ** 2 * delta / (2 * t))
            assert torch.allclose(block, expected[:2, :3], atol=1e-5)
        else:
            assert bool(((sigma >= 0.08 - 1e-6) & (sigma <= 0.16 + 1e-6)).all())
        total = total + torch.distributions.Normal(block, sigma.double().reshape(2, 3)).log_prob(
            chain[0, k + 1, :2, :3]).sum()
    assert float(total) == pytest.approx(float(out.logprobs[0]), abs=1e-3)


@pytest.mark.parametrize("kind", ["pi0", "pi05"])
def test_lora_ppo_and_grpo_train_the_adapters_and_heads_and_leave_the_checkpoint_bit_identical(kind, dirs):
    policy = build(dirs[kind], lora_rank=4)
    trainable = {k for k, p in policy.named_parameters() if p.requires_grad}
    assert any("lora_" in k for k in trainable) and "noise_head.0.weight" in trainable
    assert {k for k in trainable if "lora_" not in k and k.startswith("backbone.")} == {
        k for k in trainable if ".embed_action_time." in k or ".action_out_proj." in k}
    assert not any("vision_tower" in k for k in trainable)  # LoRA on the language model and the expert only
    assert set(policy.trainable_state_dict()) == trainable

    twin = acting_copy(policy)  # the generator's copy shares the frozen checkpoint
    frozen = {k: p for k, p in policy.named_parameters() if not p.requires_grad}
    assert all(p is frozen[k] for k, p in twin.named_parameters() if not p.requires_grad)

    metrics = ppo_grpo_keep_checkpoint(policy, observations)  # the checkpoint: bit-identical
    assert np.isfinite(metrics["kl_ref"])
    twin.load_trainable_state_dict(policy.trainable_state_dict())  # what weight publication does
    obs = observations(2, seed=9)
    noise = torch.randn(2, 4, 8)
    np.testing.assert_array_equal(twin.act(obs, noise=noise).values, policy.act(obs, noise=noise).values)


def test_without_lora_everything_trains_and_the_value_reads_the_vlm_for_pi05(dirs):
    assert all(p.requires_grad for p in build(dirs["pi0"]).parameters())
    policy = build(dirs["pi05"])
    obs = torch_obs(observations(2))
    policy.value(obs).sum().backward()  # π0.5: on the VLM's prefix, gradients into it
    assert policy.hf_model.model.vlm.language_model.layers[0].self_attn.q_proj.weight.grad is not None
    pi0 = build(dirs["pi0"])
    pi0.value(obs).sum().backward()  # π0: on the action expert, detached by default (RLinf's PPO setting)
    assert pi0.value_head[0].weight.grad is not None and pi0.hf_model.model.dit.layers[0].self_attn.q_proj.weight.grad is None


def test_gradient_checkpointing_gives_the_same_gradients_and_bf16_runs(dirs):
    obs = torch_obs(observations(3))
    grads = []
    for ckpt in (False, True):
        policy = build(dirs["pi0"], lora_rank=4, gradient_checkpointing=ckpt, detach_value_input=False)
        chain = torch.from_numpy(policy.act(observations(3), noise=torch.zeros(3, 4, 8)).actions)
        logp, _, value = policy.evaluate(obs, chain)
        (logp.sum() + value.sum()).backward()
        # (the VLM's last layer gives the expert its keys and values only: its MLP has no gradient)
        grads.append({k: p.grad.clone() for k, p in policy.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 20
    for k, g in grads[0].items():
        torch.testing.assert_close(grads[1][k], g, atol=1e-5, rtol=1e-4, msg=k)

    half = build(dirs["pi05"], lora_rank=4, dtype="bfloat16")
    assert half.hf_model.model.vlm.language_model.layers[0].mlp.up_proj.base_layer.weight.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in half.parameters() if p.requires_grad)
    out = half.act(observations(3))
    assert out.actions.dtype == np.float32 and np.isfinite(out.logprobs).all()
    logp, _, _ = half.evaluate(obs, torch.from_numpy(out.actions))
    assert logp.dtype == torch.float32
    np.testing.assert_allclose(logp.detach().numpy(), out.logprobs, atol=1e-2)


def test_sft_on_demonstrations_lowers_the_held_out_flow_loss(dirs, tmp_path):
    pytest.importorskip("pyarrow")
    from ebrl.sft import SFTConfig, sft

    demos, env = reach_demos(tmp_path)
    path = tmp_path / "reach"  # InstructedReach: a state of 4, actions of 2, no camera
    save_random_pi0(path, kind="pi0", state_dim=4, action_dim=2, chunk_size=4, sentences=tuple(env.instructions()),
                    action_std=1.0)
    policy = PI0Policy.from_pretrained(path, env.observation_space, env.action_space, instruction=env.instructions(),
                                       lora_rank=8, **SMALL)
    held_out, obs = held_out_loss(policy, demos, env)
    before = held_out()
    prefixes = []  # rows through the backbone in the value pass
    policy.value_features = lambda o, f=policy.value_features: prefixes.append(len(o["state"])) or f(o)
    train = demos.select([0, 1, 2])
    out = sft(policy, train, env.observation_space, env.action_space,
              SFTConfig(epochs=10, lr=1e-2, minibatch_size=32, val_fraction=0.0, value_pass=True,
                        value_epochs=20))
    assert out["train_loss"][-1] < out["train_loss"][0]
    assert held_out() < 0.5 * before, (before, held_out())  # measured: 1.01 -> 0.22
    # the value pass (demos with rewards, a value head): each frame through the backbone once, 20 passes on the head
    assert sum(prefixes) == len(train) and len(out["value_loss"]) == 20
    assert out["value_loss"][-1] < out["value_loss"][0]
    with torch.no_grad():
        assert torch.equal(policy.value(obs), policy.value_from_features(policy.value_features(obs)))


def test_a_missing_file_is_one_error_naming_it(dirs, tmp_path):
    with pytest.raises(FileNotFoundError, match="PI0Policy: model directory .* does not exist"):
        build(tmp_path / "nowhere")
    broken = tmp_path / "broken"
    shutil.copytree(dirs["pi0"], broken)
    (broken / "processor_config.json").unlink()
    (broken / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no processor_config.json.*; no tokenizer files"):
        build(broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="has no weights"):
        build(broken)
    with pytest.raises(ValueError, match="Discrete 'instruction' entry"):
        PI0Policy.from_pretrained(dirs["pi0"], gym.spaces.Dict({"state": space()["state"]}), ACTIONS,
                                  instruction=TASKS)
    with pytest.raises(ValueError, match="execute"):
        build(dirs["pi0"], actions=gym.spaces.Box(-1, 1, (5, 3)))  # chunks of 4
    with pytest.raises(ValueError, match="state statistics have 4 entries"):
        PI0Policy.from_pretrained(dirs["pi0"], gym.spaces.Dict({"state": gym.spaces.Box(-1, 1, (5,))}), ACTIONS,
                                  instruction="reach the goal")


def test_ppo_under_ebrl_run_in_chunks_of_two(tmp_path):
    """LoRA and PPO under ``ebrl.run`` (virtual time) on the instructed reach: a π0 reading the
    state and the instruction index (no camera), executing 2 actions of each chunk (``ebrl.run``
    wraps the Box(2) env in ActionChunk), the generator's copy sharing the frozen checkpoint."""
    import ebrl
    from ebrl.testing import InstructedReach, run_virtual

    env = InstructedReach(tasks=2, dim=2, episode_len=8)
    save_random_pi0(tmp_path, kind="pi0", state_dim=4, action_dim=2, chunk_size=4,
                    sentences=tuple(env.instructions()), action_std=1.0)
    policy = PI0Policy.from_pretrained(tmp_path, env.observation_space, env.action_space,
                                       instruction=env.instructions(), execute=2, lora_rank=4, method="flow-sde",
                                       denoise_steps=2, **SMALL)
    assert policy.expected_spaces().action.shape == (2, 2)
    before = {k: v.clone() for k, v in policy.trainable_state_dict().items()}
    res = run_virtual(ebrl.Trainer(lambda i: InstructedReach(tasks=2, dim=2, episode_len=8), policy,
                                   PPO(minibatch_size=16, update_epochs=1),
                                   ebrl.RunConfig(num_envs=4, segment_len=4, total_env_steps=96, schedule="sync")))
    assert res.accounting_ok() and res.updates >= 1
    after = policy.trainable_state_dict()
    assert any(not torch.equal(before[k], v) for k, v in after.items() if "lora_B" in k)


def test_the_cli_loads_a_checkpoint_by_its_model_type(dirs, tmp_path):
    """``--set policy.kind=hf --set policy.path=DIR`` (and ``ebrl.policies.from_pretrained``) give
    PI0Policy for a pi0 or pi05 config.json, with the env's instructions; the run executes its
    chunks on the per-step env."""
    from ebrl.policies import from_pretrained
    from ebrl.runs import build_spec, build_trainer
    from ebrl.testing import InstructedReach

    env = InstructedReach(tasks=2, dim=2)
    for kind, path in dirs.items():
        assert isinstance(from_pretrained(path, space(), ACTIONS, instruction=TASKS, **SMALL), PI0Policy)
        assert from_pretrained(path, space(), ACTIONS, instruction=TASKS).kind == kind
    save_random_pi0(tmp_path, kind="pi0", state_dim=4, action_dim=2, chunk_size=4,
                    sentences=tuple(env.instructions()))
    trainer = build_trainer(build_spec(None, ["env=mock/reach", "policy.kind=hf", f"policy.path={tmp_path}",
                                              "policy.execute=2", "policy.noise_hidden=[16]",
                                              "policy.value_hidden=[16]"]))
    policy = trainer.policy
    assert isinstance(policy, PI0Policy) and policy.expected_spaces().action.shape == (2, 2)
    built = trainer.env_fn(0)
    assert policy.texts == built.get_wrapper_attr("instructions")()
    built.close()


def test_the_gpu_script_skips_without_cuda_and_runs_its_steps_on_a_tiny_model(tmp_path, capsys):
    """bench/gpu_pi0.py, what the first GPU session runs: it says it skipped where there is no CUDA,
    and ``--tiny --device cpu`` runs every step it would time there."""
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("gpu_pi0", Path(__file__).parents[1] / "bench" / "gpu_pi0.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    if not torch.cuda.is_available():
        assert script.main(["--out", str(tmp_path / "none.json")]) == 0
        assert "skipped: no CUDA" in capsys.readouterr().out and not (tmp_path / "none.json").exists()
    assert script.main(["--tiny", "--device", "cpu", "--out", str(tmp_path / "tiny.json")]) == 0
    results = json.loads((tmp_path / "tiny.json").read_text())["results"]
    assert [Path(r["path"]).name for r in results] == ["pi0", "pi05"]
    for r in results:
        assert r["faithful_max_abs"] < 1e-5 and set(r["act_ms"]) == {"1", "2"}
        assert r["update_s"] > 0 and r["update_s_checkpointing"] > 0
        assert 0 < r["publication_mb"]["lora"] < r["publication_mb"]["whole"]


# the share of the untrained-to-expert return gap the trained π0 must close: a floor with a margin
# under every run measured (see the test's docstring), not the 30% of test_learning_reach's issue
REACH_FLOOR = 0.15


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rl_from_a_tiny_pi0_beats_its_untrained_copy_on_an_instructed_reach(tmp_path):
    """PPO through Flow-SDE on a tiny random π0 (LoRA rank 4, 2 of each 4-action chunk executed)
    on the instructed reach, under ``ebrl.run`` in virtual time on one torch thread, seeded: it
    repeats bit for bit on a machine. Within 15,000 decisions it beats its untrained copy, with
    its mode and with its samples, on 32 reset seeds it never trained on, by closing at least
    ``REACH_FLOOR`` of the return gap between the untrained copy and the scripted expert.

    The share varies with the last bits of torch's kernels (another CPU: another run): measured
    here over seeds 0-4 (policy, PPO and resets), mode 0.31-0.48 and samples 0.33-0.43 (seed 0:
    0.337 and 0.332); a CI machine's seed 0 closed 0.25 with its mode. A 30% bar sat inside that
    spread and failed there; the floor is 0.15.

    From a random model the exploration is the SDE's (``noise_level=1``): a random velocity
    field leaves the chunk near its initial unit noise, which no log-prob sees, and πRL's
    fine-tuning noise (0.5) moves it too slowly (27% of the gap in 15k decisions)."""
    import copy

    import ebrl
    from ebrl.testing import InstructedReach, run_virtual, torch_threads

    def make(i=0):
        return InstructedReach(tasks=2, dim=2, episode_len=16)

    env = make()
    save_random_pi0(tmp_path, kind="pi0", state_dim=4, action_dim=2, chunk_size=4,
                    sentences=tuple(env.instructions()), action_std=1.0)
    best = expert_return(make())
    with torch_threads(1):
        policy = PI0Policy.from_pretrained(tmp_path, env.observation_space, env.action_space,
                                           instruction=env.instructions(), execute=2, lora_rank=4, method="flow-sde",
                                           noise_level=1.0, denoise_steps=2, noise_hidden=(32,), value_hidden=(64,),
                                           seed=0)
        untrained = copy.deepcopy(policy)
        res = run_virtual(ebrl.Trainer(make, policy, PPO(minibatch_size=64, update_epochs=4, seed=0),
                                       ebrl.RunConfig(num_envs=8, segment_len=16, total_env_steps=15_000, seed=0)))
        assert res.accounting_ok() and res.env_steps == 15_000
        closed = gap_closed(untrained, policy, make, best)
    print(f"π0 instructed reach, share of the gap closed: mode {closed[True][0]:.4f}, samples {closed[False][0]:.4f}")
    for deterministic, (share, before, after) in closed.items():
        assert share >= REACH_FLOOR, (deterministic, before, after, best)


def test_sft_on_a_lerobot_dataset_then_rl_from_it_from_the_command_line(tmp_path, capsys):
    """``ebrl demos collect`` writes a LeRobot dataset, ``ebrl sft DATASET --set policy.kind=hf
    --set policy.path=DIR`` fine-tunes the π0 on it through LoRA, and ``ebrl train --set
    policy.init=SFT`` starts from exactly those trainable weights."""
    from ebrl.cli import main
    from ebrl.runs import build_spec, build_trainer
    from ebrl.testing import InstructedReach

    model = tmp_path / "pi0"
    save_random_pi0(model, kind="pi0", state_dim=4, action_dim=2, chunk_size=4,
                    sentences=tuple(InstructedReach().instructions()))
    assert main(["demos", "collect", "mock/reach", "--policy", "scripted", "--episodes", "4",
                 "--out", str(tmp_path / "demos")]) == 0
    small = ["--set", "policy.noise_hidden=[16]", "--set", "policy.value_hidden=[16]"]
    assert main(["sft", str(tmp_path / "demos"), "--set", "policy.kind=hf", "--set", f"policy.path={model}",
                 "--set", "policy.execute=2", "--set", "policy.lora_rank=4", "--set", "sft.epochs=2", *small,
                 "--out", str(tmp_path / "sft")]) == 0
    assert "sft: " in capsys.readouterr().out
    trainer = build_trainer(build_spec(None, ["env=mock/reach", f"policy.init={tmp_path / 'sft'}"]))
    policy = trainer.policy
    assert isinstance(policy, PI0Policy) and policy.expected_spaces().action.shape == (2, 2)
    fresh = build_trainer(build_spec(None, ["env=mock/reach", "policy.kind=hf", f"policy.path={model}",
                                            "policy.execute=2", "policy.lora_rank=4", "policy.noise_hidden=[16]",
                                            "policy.value_hidden=[16]"])).policy
    loaded, untouched = policy.trainable_state_dict(), fresh.trainable_state_dict()
    assert set(loaded) == set(untouched)
    assert any(not torch.equal(loaded[k], untouched[k]) for k in loaded if "lora_B" in k)  # SFT's adapters


def test_state_statistics_are_needed_only_where_a_state_is_read(dirs, tmp_path):
    """A processor_config.json without state statistics loads for an observation of cameras alone;
    with a state to normalise it is one error naming the missing statistics."""
    bare = tmp_path / "bare"
    shutil.copytree(dirs["pi0"], bare)
    config = json.loads((bare / "processor_config.json").read_text())
    (bare / "processor_config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                            if not k.startswith("state_")}))
    cameras = gym.spaces.Dict({"cam0": space()["cam0"]})
    policy = PI0Policy.from_pretrained(bare, cameras, ACTIONS, instruction="reach the goal", **SMALL)
    assert policy.act({"cam0": observations(2)["cam0"]}).env_actions.shape == (2, 2, 3)
    with pytest.raises(ValueError, match="has no state_mean and state_std"):
        build(bare)
