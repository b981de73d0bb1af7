"""HFTokenPolicy: OpenVLA-style action tokens around a local Hugging Face model.

Every model here is a tiny random one built from a config and saved to a temporary directory
(a Llama causal LM, and a LLaVA image-text model with a tiny CLIP vision tower), with a
tokenizer trained offline on a few sentences: nothing is downloaded, and every test runs with
sockets refused and ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import copy
import json
import shutil

import gymnasium as gym
import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

import ebrl  # noqa: E402
from ebrl.algos import GRPO, PPO, Batch  # noqa: E402
from ebrl.policies.hf_token import OPENVLA_PROMPT, HFTokenPolicy  # noqa: E402
from ebrl.testing import MockEnv, run_virtual, save_random_hf_model, torch_threads  # noqa: E402
from tests.policy_helpers import token_logits

VOCAB = 512
TASKS = ["pick up the red block", "open the drawer and reach the target"]  # prompts of different lengths


pytestmark = pytest.mark.usefixtures("hf_offline")  # conftest: sockets refused, the hub offline


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    # a large initializer range: sharp, distinct logits, so that log-prob checks are not trivially uniform
    save_random_hf_model(path, kind="llama", vocab=VOCAB, sentences=tuple(TASKS), initializer_range=0.3)
    return path


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llava")
    save_random_hf_model(path, kind="llava", vocab=VOCAB, sentences=tuple(TASKS), initializer_range=0.3)
    return path


def dict_space(n_tasks: int = 2) -> gym.spaces.Dict:
    return gym.spaces.Dict({"image": gym.spaces.Box(0, 255, (20, 20, 3), np.uint8),
                            "state": gym.spaces.Box(-np.inf, np.inf, (5,), np.float32),
                            "instruction": gym.spaces.Discrete(n_tasks)})


def dict_obs(n: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"image": rng.integers(0, 256, (n, 20, 20, 3), dtype=np.uint8),
            "state": rng.standard_normal((n, 5)).astype(np.float32),
            "instruction": rng.integers(0, 2, n)}


def torch_obs(obs):
    return {k: torch.as_tensor(v) for k, v in obs.items()} if isinstance(obs, dict) else torch.as_tensor(obs)


ACTIONS = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)


@pytest.fixture(scope="module")
def llama_policy(llama_dir):
    return HFTokenPolicy.from_pretrained(llama_dir, dict_space(), ACTIONS, instruction=TASKS)


@pytest.fixture(scope="module")
def llava_policy(llava_dir):
    return HFTokenPolicy.from_pretrained(llava_dir, dict_space(), ACTIONS, instruction=TASKS, lora_rank=4)


def test_loads_from_a_local_directory_offline(llama_dir, llava_dir):
    from transformers import LlamaForCausalLM, LlavaForConditionalGeneration

    causal = HFTokenPolicy.from_pretrained(llama_dir, dict_space(), ACTIONS, instruction=TASKS)
    assert isinstance(causal.hf_model, LlamaForCausalLM) and not causal.image_text
    image_text = HFTokenPolicy.from_pretrained(llava_dir, dict_space(), ACTIONS, instruction=TASKS)
    assert isinstance(image_text.hf_model, LlavaForConditionalGeneration) and image_text.image_text
    assert image_text.image_processor is not None
    for policy in (causal, image_text):
        out = policy.act(dict_obs(4))
        assert out.actions.shape == out.env_actions.shape == (4, 3) and out.actions.dtype == np.int64
        assert out.logprobs.shape == out.values.shape == (4,) and out.logprobs.dtype == np.float32
        assert np.all(np.abs(out.env_actions) <= 1.0)
        assert all(p.dtype == torch.float32 for p in policy.parameters())  # dtype="auto": float32 on the CPU
    inputs = {d["key"]: d for d in image_text.describe_inputs()}
    assert "vision tower" in inputs["image"]["features"] and inputs["instruction"]["as"] == "instruction index"
    assert "patch projection" in {d["key"]: d for d in causal.describe_inputs()}["image"]["features"]
    ebrl.policies.check_policy_spaces(causal, dict_space(), ACTIONS)
    with pytest.raises(ebrl.config.ConfigError):
        ebrl.policies.check_policy_spaces(causal, dict_space(), gym.spaces.Box(-1.0, 1.0, (4,)))


@pytest.mark.parametrize("kind", ["llama", "llava"])
def test_kv_cache_decode_gives_the_teacher_forced_logprobs(kind, llama_policy, llava_policy):
    policy = llama_policy if kind == "llama" else llava_policy
    obs = dict_obs(6, seed=1)
    assert len(set(obs["instruction"].tolist())) == 2  # both prompt lengths (one row left-padded) in one batch
    out = policy.act(obs)
    with torch.no_grad():
        logp, entropy, value = policy.evaluate(torch_obs(obs), torch.from_numpy(out.actions))
        full_logits, _ = token_logits(policy, torch_obs(obs), torch.from_numpy(out.actions))
    _, cached_logits, _ = policy.decode(obs, torch.from_numpy(out.actions))
    torch.testing.assert_close(cached_logits, full_logits, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(out.logprobs, logp.numpy(), atol=1e-5)
    np.testing.assert_allclose(out.values, value.numpy(), atol=1e-5)
    np.testing.assert_allclose(policy.value(torch_obs(obs)).detach().numpy(), out.values, atol=1e-5)
    assert np.all(out.logprobs < -1.0) and bool((entropy > 0).all())

    # a row reads as it would alone: left padding and its positions change nothing
    alone = {k: v[:1] for k, v in obs.items()}
    with torch.no_grad():
        logp_alone = policy.evaluate(torch_obs(alone), torch.from_numpy(out.actions[:1]))[0]
    np.testing.assert_allclose(logp_alone.numpy(), logp[:1].numpy(), atol=1e-5)


def test_action_tokenizer_uses_the_last_256_ids_and_round_trips_bin_centres(llama_policy):
    policy = llama_policy
    assert policy.vocab_size == VOCAB
    np.testing.assert_array_equal(policy.token_ids(np.arange(256)).numpy(), VOCAB - 1 - np.arange(256))
    assert set(policy.action_token_ids.tolist()) == set(range(VOCAB - 256, VOCAB))
    bins = np.random.default_rng(0).integers(0, 256, (100, 3))
    centres = policy.detokenize(bins)
    np.testing.assert_allclose(centres, -1.0 + (bins + 0.5) * 2.0 / 256, atol=1e-6)
    np.testing.assert_array_equal(policy.tokenize(centres), bins)
    np.testing.assert_array_equal(policy.tokenize(np.array([-1.0, 1.0, 5.0])), [0, 255, 255])
    with pytest.raises(ValueError, match="token ids"):
        policy.evaluate(torch_obs(dict_obs(2)), torch.full((2, 3), 256))


def test_action_stats_bound_the_bins_and_env_actions_stay_in_the_box(llama_dir):
    stats = {"action": {"q01": [-0.5, 0.0, -2.0], "q99": [0.5, 0.25, 2.0]}}  # the last reaches past the Box
    policy = HFTokenPolicy.from_pretrained(llama_dir, dict_space(), ACTIONS, instruction=TASKS, action_stats=stats)
    np.testing.assert_array_equal(policy.tokenize(np.array([-0.5, 0.0, -2.0])), [0, 0, 0])
    np.testing.assert_array_equal(policy.tokenize(np.array([0.5, 0.25, 2.0])), [255, 255, 255])
    out = policy.act(dict_obs(64))
    assert np.all(np.abs(out.env_actions) <= 1.0)
    assert np.all((out.env_actions[:, 0] >= -0.5) & (out.env_actions[:, 0] <= 0.5))
    assert policy.config["action_stats"] == {"q01": [-0.5, 0.0, -2.0], "q99": [0.5, 0.25, 2.0]}


def test_logprob_is_the_sum_of_the_token_logprobs_of_the_models_own_logits(llama_policy):
    policy = llama_policy
    obs = dict_obs(5, seed=2)
    actions = torch.from_numpy(policy.act(obs).actions)
    with torch.no_grad():
        embeds, mask, positions = policy._prefix(torch_obs(obs))
        ids = policy.token_ids(actions)  # [5, 3] vocabulary ids
        inputs = torch.cat([embeds, policy.hf_model.get_input_embeddings()(ids[:, :-1])], 1)
        mask = torch.cat([mask, torch.ones(5, 2, dtype=mask.dtype)], 1)
        positions = torch.cat([positions, positions[:, -1:] + torch.arange(1, 3)], 1)
        logits = policy.hf_model(inputs_embeds=inputs, attention_mask=mask, position_ids=positions).logits
        logits = logits[:, embeds.shape[1] - 1:]  # [5, 3, VOCAB]: the positions that predict each dimension
        by_hand = torch.zeros(5)
        for n in range(5):
            for j in range(3):
                restricted = logits[n, j, VOCAB - 256:]  # the action tokens only
                by_hand[n] += restricted[ids[n, j] - (VOCAB - 256)] - torch.logsumexp(restricted, 0)
        logp = policy.evaluate(torch_obs(obs), actions)[0]
    np.testing.assert_allclose(logp.numpy(), by_hand.numpy(), atol=1e-5)


def _ppo_batch(policy, obs: dict, S: int = 2, T: int = 4):
    out = policy.act(obs)
    shaped = {k: torch.as_tensor(v).reshape(S, T, *np.shape(v)[1:]) for k, v in obs.items()}
    no = torch.zeros(S, T, dtype=torch.bool)
    boot = {k: v[:, 0] for k, v in shaped.items()}
    final = {k: v[:0, 0] for k, v in shaped.items()}
    return Batch(shaped, torch.from_numpy(out.actions).reshape(S, T, -1), torch.from_numpy(out.logprobs).reshape(S, T),
                 torch.from_numpy(out.values).reshape(S, T),
                 torch.randn(S, T, generator=torch.Generator().manual_seed(0)),
                 no, no, torch.ones(S, T, dtype=torch.bool), torch.zeros(S, T, dtype=torch.long), boot, final,
                 torch.zeros(0, 2, dtype=torch.long))


def test_lora_trains_only_the_adapters_and_the_added_layers(llama_dir, tmp_path):
    policy = HFTokenPolicy.from_pretrained(llama_dir, dict_space(), ACTIONS, instruction=TASKS, lora_rank=4)
    assert policy.config["lora"] == {"rank": 4, "alpha": 4.0, "targets": ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                         "gate_proj", "up_proj", "down_proj"]}
    named = dict(policy.named_parameters())
    trainable = {k for k, p in named.items() if p.requires_grad}
    assert trainable and all("lora_" in k or not k.startswith("backbone.") for k in trainable)
    assert {"state_proj.weight", "value_head.weight", "camera_proj.0.proj.weight"} <= trainable
    base = {k: v.clone() for k, v in policy.state_dict().items() if k.startswith("backbone.") and "lora_" not in k}
    lora_before = {k: v.clone() for k, v in policy.state_dict().items() if "lora_B" in k}

    metrics = PPO(minibatch_size=4, update_epochs=2, lr=1e-2).update(policy, _ppo_batch(policy, dict_obs(8)))
    assert metrics["minibatches"] == 4.0 and metrics["nonfinite_loss"] == 0.0
    after = policy.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items())  # the base model: bit-identical
    assert all(not torch.equal(after[k], v) for k, v in lora_before.items())  # every adapter moved

    small = policy.trainable_state_dict()
    assert set(small) == trainable | {"obs_encoder.obs_mean", "obs_encoder.obs_var", "obs_encoder.obs_count"}
    assert not torch.equal(small["obs_encoder.obs_mean"], torch.zeros(5))  # PPO merged the observation statistics
    full_numel = sum(v.numel() for v in after.values())
    assert sum(v.numel() for v in small.values()) < full_numel / 3
    # and without LoRA the whole backbone trains
    plain = HFTokenPolicy.from_pretrained(llama_dir, dict_space(), ACTIONS, instruction=TASKS)
    assert all(p.requires_grad for p in plain.parameters())


def test_save_and_load_adapters_round_trip(llava_dir, tmp_path):
    policy = HFTokenPolicy.from_pretrained(llava_dir, dict_space(), ACTIONS, instruction=TASKS, lora_rank=4, seed=3)
    PPO(minibatch_size=4, update_epochs=1, lr=1e-2).update(policy, _ppo_batch(policy, dict_obs(8)))
    policy.save_adapters(tmp_path / "adapters")
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == ["adapters.safetensors", "ebrl_policy.json"]
    saved = json.loads((tmp_path / "adapters" / "ebrl_policy.json").read_text())
    assert saved["base_path"] == str(llava_dir.resolve()) and saved["instruction"] == TASKS
    assert saved["prompt"] == OPENVLA_PROMPT and saved["lora"]["rank"] == 4

    for loaded in (HFTokenPolicy.load_adapters(tmp_path / "adapters"),
                   HFTokenPolicy.load_adapters(tmp_path / "adapters", dict_space(), ACTIONS)):
        for k, v in policy.trainable_state_dict().items():
            assert torch.equal(v, loaded.trainable_state_dict()[k]), k
        policy._gen.manual_seed(3)  # a fresh sampling stream, as the loaded policy has
        obs = dict_obs(6, seed=4)
        for _ in range(2):
            a, b = policy.act(obs), loaded.act(obs)
            np.testing.assert_array_equal(a.actions, b.actions)
            np.testing.assert_array_equal(a.logprobs, b.logprobs)
            np.testing.assert_array_equal(a.values, b.values)

    with pytest.raises(KeyError, match="missing"):
        policy.load_trainable_state_dict({})
    with pytest.raises(ValueError, match="saved for a Box action space"):
        HFTokenPolicy.load_adapters(tmp_path / "adapters", dict_space(), gym.spaces.Box(-2.0, 2.0, (3,)))
    with pytest.raises(ebrl.config.ConfigError):
        HFTokenPolicy.load_adapters(tmp_path / "adapters", dict_space(3), ACTIONS)

    twin = copy.deepcopy(policy)  # what ebrl.run does to make the acting copy
    twin._gen.manual_seed(5)
    policy._gen.manual_seed(5)
    np.testing.assert_array_equal(twin.act(dict_obs(4)).actions, policy.act(dict_obs(4)).actions)


@pytest.mark.parametrize("remove, match", [
    ("config.json", "config.json"), ("model.safetensors", "weights"), ("tokenizer.json", "tokenizer files"),
    ("preprocessor_config.json", "image processor"), (None, "does not exist")])
def test_an_incomplete_directory_is_one_clear_error(llava_dir, tmp_path, remove, match):
    path = tmp_path / "model"
    if remove is not None:
        shutil.copytree(llava_dir, path)
        (path / remove).unlink()
    with pytest.raises(FileNotFoundError, match=match) as info:
        HFTokenPolicy.from_pretrained(path, dict_space(), ACTIONS, instruction=TASKS)
    assert str(path) in str(info.value) and "never downloads" in str(info.value)


def test_instruction_errors_are_clear(llama_dir):
    with pytest.raises(ValueError, match="Discrete 'instruction'"):
        HFTokenPolicy.from_pretrained(llama_dir, gym.spaces.Box(-1, 1, (3,)), ACTIONS, instruction=TASKS)
    with pytest.raises(ValueError, match="one instruction per value"):
        HFTokenPolicy.from_pretrained(llama_dir, dict_space(3), ACTIONS, instruction=TASKS)
    with pytest.raises(ValueError, match="give instruction="):
        HFTokenPolicy.from_pretrained(llama_dir, gym.spaces.Box(-1, 1, (3,)), ACTIONS)
    fixed = HFTokenPolicy.from_pretrained(llama_dir, gym.spaces.Box(-1, 1, (3,)), ACTIONS, prompt="Out:",
                                          value_head=False)
    out = fixed.act(np.zeros((2, 3), np.float32))
    assert np.all(out.values == 0) and not hasattr(fixed, "value_head")
    assert torch.equal(fixed.value(torch.zeros(2, 3)), torch.zeros(2))


def _reach_score(policy) -> float:
    """Mean MockEnv reward of the policy's sampled actions on 512 fixed targets (random actions: about 0.3)."""
    targets = np.random.default_rng(5).uniform(-1, 1, (512, 2)).astype(np.float32)
    return float((1.0 - np.abs(policy.act(targets).env_actions - targets).mean(1)).mean())


def test_learns_to_reach_under_ebrl_run(llama_dir):
    """LoRA and PPO under ``ebrl.run`` in virtual time (one torch thread, seeded: the same batches
    and the same numbers in every run on a machine; a run on real threads forms its batches as
    the envs happen to arrive): the counters add up, and after 6k steps the policy beats its
    untrained copy. Measured 0.306 -> 0.379 in 4k steps; over seeds 0-4 the gain is 0.065-0.114
    (6k steps: 0.079-0.139, and half again the time). The learner process (real time) trains an
    HF policy in test_policy_registry's CLI run."""
    env = MockEnv(dim=2, episode_len=8)
    with torch_threads(1):
        policy = HFTokenPolicy.from_pretrained(llama_dir, env.observation_space, env.action_space,
                                               instruction="reach the target", lora_rank=8)
        untrained = copy.deepcopy(policy)
        res = run_virtual(ebrl.Trainer(
            lambda i: MockEnv(dim=2, episode_len=8), policy, PPO(minibatch_size=64, lr=1e-2),
            ebrl.RunConfig(num_envs=8, segment_len=16, total_env_steps=4096, schedule="sync")))
        before, after = _reach_score(untrained), _reach_score(policy)
    print(f"hf-token PPO: {before:.4f} -> {after:.4f}")  # with -s
    assert res.accounting_ok()
    assert res.env_steps >= 4096 and res.updates >= 16
    assert after > before + 0.03, (before, after)


def test_learns_to_reach_with_grpo(llama_dir):
    """GRPO, with no value head: group-relative advantages over episodes from shared resets
    (groups of 4 envs see the same targets), in virtual time on one torch thread. After 2k steps
    the policy beats its untrained copy (measured: 0.306 -> 0.564; over seeds 0-4 the gain is
    0.148-0.278)."""
    env = MockEnv(dim=2, episode_len=4)
    with torch_threads(1):
        policy = HFTokenPolicy.from_pretrained(llama_dir, env.observation_space, env.action_space,
                                               instruction="reach the target", lora_rank=8, value_head=False)
        untrained = copy.deepcopy(policy)
        res = run_virtual(ebrl.Trainer(
            lambda i: MockEnv(dim=2, episode_len=4), policy, GRPO(minibatch_size=64, lr=1e-2),
            ebrl.RunConfig(num_envs=8, segment_len=4, total_env_steps=2048)))
        before, after = _reach_score(untrained), _reach_score(policy)
    print(f"hf-token GRPO: {before:.4f} -> {after:.4f}")  # with -s
    assert res.accounting_ok() and res.updates >= 8
    assert after > before + 0.03, (before, after)


def test_gradient_checkpointing_and_bf16_autocast(llama_dir):
    plain = HFTokenPolicy.from_pretrained(llama_dir, dict_space(), ACTIONS, instruction=TASKS, lora_rank=4)
    ckpt = HFTokenPolicy.from_pretrained(llama_dir, dict_space(), ACTIONS, instruction=TASKS, lora_rank=4,
                                         gradient_checkpointing=True)
    obs, actions = torch_obs(dict_obs(4)), torch.from_numpy(plain.act(dict_obs(4)).actions)
    layers = [m for m in ckpt.backbone.modules() if getattr(m, "gradient_checkpointing", False) is True
              and hasattr(m, "_gradient_checkpointing_func")]
    assert layers
    recomputed = []
    for layer in layers:  # count the checkpointed calls: the flag alone proves nothing
        def counted(*args, _inner=layer._gradient_checkpointing_func, **kwargs):
            recomputed.append(1)
            return _inner(*args, **kwargs)
        layer._gradient_checkpointing_func = counted
    grads = []
    for policy in (plain, ckpt):
        logp, _, value = policy.evaluate(obs, actions)
        (logp.sum() + value.sum()).backward()
        grads.append({k: p.grad.clone() for k, p in policy.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys()
    assert len(recomputed) == 2  # the two decoder layers, in the one pass with gradients
    for k, g in grads[0].items():
        torch.testing.assert_close(grads[1][k], g, atol=1e-5, rtol=1e-4, msg=k)
    with torch.no_grad():  # acting: no checkpointing, the KV cache kept
        out = ckpt.act(dict_obs(4))
        logp = ckpt.evaluate(obs, torch.from_numpy(out.actions))[0]
        np.testing.assert_allclose(out.logprobs, logp.numpy(), atol=1e-5)
    assert len(recomputed) == 2

    bf16 = HFTokenPolicy.from_pretrained(llama_dir, dict_space(), ACTIONS, instruction=TASKS, lora_rank=4,
                                         autocast_bf16=True)
    out = bf16.act(dict_obs(4))
    assert np.all(np.isfinite(out.logprobs))
    assert all(p.dtype == torch.float32 for p in bf16.parameters() if p.requires_grad)
    with torch.no_grad():  # bf16 rounding: the two passes agree roughly, not to float32 precision
        logp = bf16.evaluate(torch_obs(dict_obs(4)), torch.from_numpy(out.actions))[0]
    np.testing.assert_allclose(out.logprobs, logp.numpy(), atol=0.5)

    # a bf16 base: frozen in bf16, what trains stays float32
    half = HFTokenPolicy.from_pretrained(llama_dir, dict_space(), ACTIONS, instruction=TASKS, lora_rank=4,
                                         dtype="bfloat16")
    assert half.hf_model.get_input_embeddings().weight.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in half.parameters() if p.requires_grad)
    logp, _, value = half.evaluate(obs, torch.from_numpy(half.act(dict_obs(4)).actions))
    (logp.sum() + value.sum()).backward()
    assert half.state_proj.weight.grad is not None and bool(torch.isfinite(logp).all())
    assert half.config["dtype"] == "bfloat16"


def test_grpo_trains_it_without_a_value_head(llama_dir):
    from ebrl.algos.grpo import GRPO

    policy = HFTokenPolicy.from_pretrained(llama_dir, dict_space(), ACTIONS, instruction=TASKS, lora_rank=4,
                                           value_head=False)
    batch = _ppo_batch(policy, dict_obs(8))
    batch.terminated[:, -1] = True
    batch.group = torch.tensor([7, 7])
    batch.rewards[0], batch.rewards[1] = 1.0, 0.0
    before = {k: v.clone() for k, v in policy.trainable_state_dict().items()}
    algo = GRPO(kl_coef=0.05, minibatch_size=4, lr=1e-2)
    metrics = algo.update(policy, batch)
    assert metrics["segments_used"] == 2.0 and np.isfinite(metrics["kl_ref"])
    # the KL reference shares the frozen backbone (no second copy of it), and saves only what trains
    frozen = [n for n, p in policy.named_parameters() if not p.requires_grad]
    ref = dict(algo.reference.named_parameters())
    assert frozen and all(ref[n] is dict(policy.named_parameters())[n] for n in frozen)
    assert set(algo.state_dict()["reference"]) == set(policy.trainable_state_dict())
    assert any(not torch.equal(v, before[k]) for k, v in policy.trainable_state_dict().items() if "lora_B" in k)


def test_from_pretrained_picks_the_token_policy_by_model_type(llama_dir, llava_dir, tmp_path):
    """``ebrl.policies.from_pretrained`` / ``policy.kind=hf``: a causal LM or an image-text model
    gives HFTokenPolicy; a folder without config.json, or of a kind EBRL cannot act with, is one
    error naming it."""
    import json

    from ebrl.policies import HFTokenPolicy as Exported
    from ebrl.policies import build_policy, from_pretrained

    assert Exported is HFTokenPolicy
    for path in (llama_dir, llava_dir):
        assert isinstance(from_pretrained(path, dict_space(), ACTIONS, instruction=TASKS), HFTokenPolicy)
    assert isinstance(build_policy("hf", dict_space(), ACTIONS, path=str(llama_dir), instruction=TASKS), HFTokenPolicy)
    with pytest.raises(ValueError, match="policy.kind=hf needs policy.path"):
        build_policy("hf", dict_space(), ACTIONS)
    with pytest.raises(FileNotFoundError, match="config.json' does not exist"):
        from_pretrained(tmp_path, dict_space(), ACTIONS)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "resnet"}))
    with pytest.raises(ValueError, match="holds a .resnet. model"):
        from_pretrained(tmp_path, dict_space(), ACTIONS)
