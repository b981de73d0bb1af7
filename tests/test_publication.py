"""Weight publication carries what trains: a policy with a frozen part publishes, checkpoints and
resumes with its trainable tensors only, and its acting copy shares the frozen part."""

import asyncio

import pytest
import torch

import ebrl
from ebrl.algos import PPO
from ebrl.checkpoint import load_checkpoint, load_safely
from ebrl.policies import MLPPolicy
from ebrl.policies.base import acting_copy, load_published, published_state, state_nbytes
from ebrl.testing import MockEnv, run_virtual


class FrozenCritic(MLPPolicy):
    """An MLP whose critic stands in for a frozen pretrained backbone: it never trains."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.critic.requires_grad_(False)

    def trainable_state_dict(self) -> dict:
        names = {n for n, p in self.named_parameters() if p.requires_grad}
        return {k: v for k, v in self.state_dict().items() if k in names or not k.startswith("critic.")}

    def load_trainable_state_dict(self, state: dict) -> None:
        missing = set(self.trainable_state_dict()) - set(state)
        assert not missing, missing
        self.load_state_dict(state, strict=False)


def trainer(policy, tmp_path=None, **cfg):
    config = ebrl.RunConfig(num_envs=4, segment_len=16, total_env_steps=256,
                            log_dir=None if tmp_path is None else str(tmp_path), **cfg)
    return ebrl.Trainer(lambda i: MockEnv(dim=3, episode_len=8), policy, PPO(minibatch_size=32), config)


def test_full_policy_publishes_its_whole_state():
    policy = MLPPolicy(3, 3, hidden=(8,), seed=0)
    result = run_virtual(trainer(policy))
    assert result.publications == result.updates > 0
    assert result.publish_bytes == state_nbytes(policy.state_dict())
    assert all(row["publish_bytes"] == result.publish_bytes for row in result.history)


def test_frozen_part_is_neither_published_nor_trained(tmp_path):
    policy = FrozenCritic(3, 3, hidden=(8,), seed=0)
    critic_before = {k: v.clone() for k, v in policy.critic.state_dict().items()}
    actor_before = policy.actor[0].weight.detach().clone()
    trainable = published_state(policy)
    assert not any(k.startswith("critic.") for k in trainable)
    result = asyncio.run(ebrl.run(trainer(policy, tmp_path, checkpoint_every_s=0.0)))
    assert result.publish_bytes == state_nbytes(trainable) < state_nbytes(policy.state_dict())
    for k, v in policy.critic.state_dict().items():
        assert torch.equal(v, critic_before[k]), k  # frozen: bit-identical
    assert not torch.equal(policy.actor[0].weight, actor_before)  # the rest trained
    saved = load_safely(tmp_path / "checkpoint.pt")["policy"]
    assert set(saved) == set(trainable)  # checkpoints hold what trains


def test_acting_copy_shares_the_frozen_part_and_loads_publications():
    policy = FrozenCritic(3, 3, hidden=(8,), seed=0)
    acting = acting_copy(policy)
    assert acting.critic[0].weight is policy.critic[0].weight  # frozen: shared, as a pretrained backbone
    assert acting.actor[0].weight is not policy.actor[0].weight
    with torch.no_grad():
        policy.actor[0].weight.add_(1.0)
    load_published(acting, published_state(policy))
    assert torch.equal(acting.actor[0].weight, policy.actor[0].weight)
    plain = MLPPolicy(3, 3, hidden=(8,), seed=0)
    assert acting_copy(plain).actor is not plain.actor  # others: a deep copy


def test_resume_loads_a_trainable_only_checkpoint(tmp_path):
    policy = FrozenCritic(3, 3, hidden=(8,), seed=0)
    asyncio.run(ebrl.run(trainer(policy, tmp_path, checkpoint_every_s=0.0)))
    fresh = FrozenCritic(3, 3, hidden=(8,), seed=0)
    load_checkpoint(tmp_path / "checkpoint.pt", trainer(fresh))
    assert torch.equal(fresh.actor[0].weight, policy.actor[0].weight)
    with pytest.raises(AssertionError):  # a checkpoint missing trainable tensors does not load quietly
        load_published(fresh, {})
