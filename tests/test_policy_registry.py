"""``register_policy``: a user's own model behind ``policy.kind`` (CLI) and ``Trainer(policy=...)``."""

import json
import textwrap

import gymnasium as gym
import pytest

from ebrl.cli import main
from ebrl.runs import build_spec, build_trainer
from ebrl.config import ConfigError
from ebrl.policies import MLPPolicy, build_policy, policy_kinds, register_policy, unregister_policy

BOX3, BOX2 = gym.spaces.Box(-1, 1, (3,)), gym.spaces.Box(-1, 1, (2,))


class WideMLP(MLPPolicy):
    """A user's class: EBRL's MLP with wider layers and a mark to find it by."""

    @classmethod
    def from_spaces(cls, observation_space, action_space, *, width=48, **kw):
        return super().from_spaces(observation_space, action_space, hidden=(width,), **kw)


@pytest.fixture
def wide():
    register_policy("wide", WideMLP)
    yield
    unregister_policy("wide")


def test_registered_kind_builds_and_is_listed(wide):
    policy = build_policy("wide", BOX3, BOX2, width=24, seed=3)
    assert isinstance(policy, WideMLP) and policy.actor[0].out_features == 24
    assert "wide" in policy_kinds() and policy_kinds()[0] == "auto"
    with pytest.raises(ValueError, match="already registered"):
        register_policy("wide", WideMLP)
    register_policy("wide", WideMLP, replace=True)  # allowed when asked for


def test_bad_registrations_are_refused():
    with pytest.raises(ValueError, match="EBRL's own"):
        register_policy("mlp", WideMLP)
    with pytest.raises(ValueError, match="other than 'auto'"):
        register_policy("auto", WideMLP)
    with pytest.raises(TypeError, match="callable"):
        register_policy("nothing", 3)
    with pytest.raises(KeyError, match="unknown policy kind 'nope'.*register_policy"):
        build_policy("nope", BOX3, BOX2)


def test_cli_builds_a_registered_kind_and_names_unknown_keywords(wide):
    trainer = build_trainer(build_spec(None, ["env=mock/3", "policy.kind=wide", "policy.width=20"]))
    assert isinstance(trainer.policy, WideMLP) and trainer.policy.actor[0].out_features == 20
    with pytest.raises(ConfigError, match="policy.*wide: .*colour"):
        build_trainer(build_spec(None, ["env=mock/3", "policy.kind=wide", "policy.colour=1"]))


def test_hf_token_without_a_path_is_one_clear_error():
    pytest.importorskip("transformers")
    with pytest.raises(ConfigError, match="policy.kind='hf-token'.*needs policy.path"):
        build_trainer(build_spec(None, ["env=mock/3", "policy.kind=hf-token"]))


def test_train_imports_a_users_module_that_registers_a_kind(tmp_path):
    module = tmp_path / "my_policies.py"
    module.write_text(textwrap.dedent("""
        from ebrl.policies import MLPPolicy, register_policy

        class Tiny(MLPPolicy):
            @classmethod
            def from_spaces(cls, observation_space, action_space, **kw):
                return super().from_spaces(observation_space, action_space, hidden=(8,), **kw)

        register_policy("tiny-user", Tiny, replace=True)
    """))
    try:
        code = main(["train", "--quiet", "--import", str(module), "--log-dir", str(tmp_path / "run"),
                     "--set", "env=mock/3", "--set", "policy.kind=tiny-user", "--set", "run.num_envs=2",
                     "--set", "run.segment_len=8", "--set", "run.total_env_steps=64", "--set", "ppo.minibatch_size=8"])
        assert code == 0
        spec = json.loads((tmp_path / "run" / "spec.json").read_text())
        assert spec["policy"]["kind"] == "tiny-user"
    finally:
        unregister_policy("tiny-user")
    assert main(["train", "--quiet", "--import", str(tmp_path / "missing.py"), "--set", "env=mock/3"]) == 2


def test_hf_token_trains_from_the_cli_and_resumes_from_its_adapters(tmp_path, hf_offline):
    """A user's Hugging Face model by path: trained by ``ebrl train`` with LoRA, the env's own
    instructions read through its tokenizer, only trainable tensors in the checkpoint, adapters
    written, and ``--resume`` loading them."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from safetensors.torch import load_file

    from ebrl.checkpoint import load_safely
    from ebrl.testing import InstructedReach, save_random_hf_model

    model = tmp_path / "model"
    save_random_hf_model(model, sentences=tuple(InstructedReach().instructions()))
    flags = ["--quiet", "--set", "env=mock/reach", "--set", "policy.kind=hf-token", "--set", f"policy.path={model}",
             "--set", "policy.lora_rank=4", "--set", "run.num_envs=2", "--set", "run.segment_len=8",
             "--set", "run.total_env_steps=32", "--set", "ppo.minibatch_size=8"]
    assert main(["train", "--log-dir", str(tmp_path / "run"), *flags]) == 0
    spec = json.loads((tmp_path / "run" / "spec.json").read_text())
    assert spec["policy"]["kind"] == "hf-token"
    saved = load_safely(tmp_path / "run" / "checkpoint.pt")["policy"]
    adapters = load_file(str(tmp_path / "run" / "adapters" / "adapters.safetensors"))
    assert set(saved) == set(adapters) and any("lora_" in k for k in saved)
    assert not any("lora_" not in k and k.startswith("backbone.") for k in saved)  # the frozen base stays out
    policy_json = json.loads((tmp_path / "run" / "adapters" / "ebrl_policy.json").read_text())
    assert policy_json["instruction"] == InstructedReach().instructions()
    resumed = ["train", "--log-dir", str(tmp_path / "again"), "--resume", str(tmp_path / "run" / "checkpoint.pt"),
               *flags[:-4], "--set", "run.total_env_steps=64", "--set", "ppo.minibatch_size=8"]
    assert main(resumed) == 0
