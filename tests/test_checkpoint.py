"""Checkpoints load with ``weights_only=True``: a crafted or damaged file is refused with a clear error, never run."""

import pathlib

import pytest
import torch

import ebrl
from ebrl.algos import PPO
from ebrl.checkpoint import load_checkpoint, save_checkpoint
from ebrl.policies import MLPPolicy
from ebrl.testing import MockEnv


def _trainer():
    return ebrl.Trainer(lambda i: MockEnv(), MLPPolicy(3, 4, seed=0), PPO())


class Touch:
    """Unpickling this creates ``path``: what a malicious checkpoint would do (with os.system)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.path),)


def test_a_pickle_that_would_run_code_is_refused_and_does_not_run(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"format": 1, "policy": {}, "algo": None, "policy_class": "MLPPolicy", "meta": Touch(marker)}, path)
    with pytest.raises(ValueError, match=r"evil\.pt holds objects a checkpoint never does and was not loaded"):
        load_checkpoint(path, _trainer())
    assert not marker.exists()


def test_a_truncated_or_foreign_file_gets_a_clear_error(tmp_path):
    good = tmp_path / "good.pt"
    save_checkpoint(good, _trainer(), env_steps=7)
    data = good.read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cut\.pt is not a readable checkpoint \(truncated or corrupt"):
        load_checkpoint(cut, _trainer())
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match=r"junk\.pt is not a readable checkpoint"):
        load_checkpoint(junk, _trainer())
    plain = tmp_path / "plain.pt"
    torch.save({"weights": torch.zeros(2)}, plain)  # loads safely, but is no EBRL checkpoint
    with pytest.raises(ValueError, match="is not an EBRL checkpoint"):
        load_checkpoint(plain, _trainer())
    assert load_checkpoint(good, _trainer())["env_steps"] == 7


def test_a_checkpoint_whose_keys_are_not_the_trainers_is_refused_naming_them(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, _trainer(), env_steps=7)
    data = torch.load(path, weights_only=True)
    renamed = {**data, "policy": {k.removeprefix("obs_encoder."): v for k, v in data["policy"].items()}}
    torch.save(renamed, path)
    with pytest.raises(ValueError, match=r'does not fit the trainer\'s MLPPolicy: (?s:.*)Unexpected key.*"obs_mean"'):
        load_checkpoint(path, _trainer())
    torch.save({**data, "algo": {k: v for k, v in data["algo"].items() if k != "updates"}}, path)
    with pytest.raises(ValueError, match="checkpoint.pt: the PPO state lacks 'updates'"):
        load_checkpoint(path, _trainer())


def test_a_checkpoint_with_optimiser_state_round_trips_under_weights_only(tmp_path):
    env = MockEnv(dim=3, episode_len=16)
    make = lambda seed: MLPPolicy.from_spaces(env.observation_space, env.action_space, seed=seed)  # noqa: E731
    trainer = ebrl.Trainer(lambda i: MockEnv(dim=3, episode_len=16), make(0), PPO(minibatch_size=64),
                           ebrl.RunConfig(num_envs=4, segment_len=16, total_env_steps=256))
    ebrl.run_sync(trainer)
    assert trainer.algo.state_dict()["optimizer"] is not None  # Adam's moments and step counts
    path = tmp_path / "trained.pt"
    save_checkpoint(path, trainer, env_steps=256)
    fresh = ebrl.Trainer(lambda i: MockEnv(dim=3), make(1), PPO(minibatch_size=64))
    assert load_checkpoint(path, fresh)["env_steps"] == 256
    for a, b in zip(trainer.policy.parameters(), fresh.policy.parameters()):
        assert torch.equal(a, b)
