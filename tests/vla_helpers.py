"""What the VLA flow policies' tests share (tests/test_pi0.py, tests/test_lerobot_pi0.py,
tests/test_smolvla_policy.py): a PPO batch from a policy's own acts, PPO then GRPO updates that must
leave the checkpoint bit-identical, the instructed reach's demonstrations and held-out flow loss,
and the scripted expert's return and the share of the gap an RL run closes on it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ebrl.algos import GRPO, PPO, Batch


def ppo_batch(policy, obs: dict, S: int = 2, T: int = 3, group: bool = False) -> Batch:
    """A batch of ``S`` segments of ``T`` steps of ``policy``'s acts on ``obs`` (``S * T`` rows),
    random advantages; ``group``: every segment a whole episode (GRPO)."""
    out = policy.act(obs)
    shaped = {k: torch.as_tensor(v).reshape(S, T, *np.shape(v)[1:]) for k, v in obs.items()}
    no = torch.zeros(S, T, dtype=torch.bool)
    end = no.clone()
    end[:, -1] = group  # GRPO: every segment a whole episode
    return Batch(shaped, torch.from_numpy(out.actions).reshape(S, T, *out.actions.shape[1:]),
                 torch.from_numpy(out.logprobs).reshape(S, T), torch.from_numpy(out.values).reshape(S, T),
                 torch.randn(S, T, generator=torch.Generator().manual_seed(0)), end, no,
                 torch.ones(S, T, dtype=torch.bool), torch.zeros(S, T, dtype=torch.long),
                 {k: v[:, 0] for k, v in shaped.items()}, {k: v[:0, 0] for k, v in shaped.items()},
                 torch.zeros(0, 2, dtype=torch.long), group=torch.zeros(S, dtype=torch.long) if group else None)


def ppo_grpo_keep_checkpoint(policy, observations: Callable[..., dict]) -> dict[str, float]:
    """A PPO update then a GRPO update of a LoRA ``policy`` on ``observations(6)`` and
    ``observations(6, seed=1)``: both finite, the frozen weights bit-identical after each, the
    adapters, ``action_out_proj`` and both heads moved by PPO. GRPO's metrics."""
    trainable = {k for k, p in policy.named_parameters() if p.requires_grad}
    base = {k: v.clone() for k, v in policy.state_dict().items() if k not in trainable}
    before = {k: v.clone() for k, v in policy.trainable_state_dict().items()}

    metrics = PPO(minibatch_size=3, update_epochs=1, lr=1e-3).update(policy, ppo_batch(policy, observations(6)))
    assert metrics["nonfinite_loss"] == 0.0 and np.isfinite(metrics["policy_loss"])
    after = policy.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items())  # the checkpoint: bit-identical
    moved = {k for k, v in before.items() if not torch.equal(after[k], v)}
    assert any("lora_B" in k for k in moved) and any(".action_out_proj." in k for k in moved)
    assert {"noise_head.0.weight", "value_head.0.weight"} <= moved

    grpo = GRPO(minibatch_size=6, update_epochs=1, lr=1e-3, kl_coef=0.1)
    metrics = grpo.update(policy, ppo_batch(policy, observations(6, seed=1), group=True))
    assert metrics["nonfinite_loss"] == 0.0 and metrics["steps_used"] == 6.0
    assert all(torch.equal(policy.state_dict()[k], v) for k, v in base.items())
    return metrics


def reach_demos(root):
    """Four demonstrations of mock/reach written to and read from ``root / "demos"``, and the
    :class:`~ebrl.testing.InstructedReach` they are for (a state of 4, actions of 2, no camera)."""
    from ebrl.demos import collect, read_lerobot
    from ebrl.testing import InstructedReach

    collect("mock/reach", root / "demos", episodes=4)
    return read_lerobot(root / "demos"), InstructedReach()


def held_out_loss(policy, demos, env) -> tuple[Callable[[], float], dict]:
    """The policy's flow-matching loss on the last demonstration (a fixed generator, no
    gradients), as a function, and that demonstration's observations."""
    from ebrl.demos.features import ObsFeatures

    held = demos.select([3])
    obs = {k: torch.as_tensor(v) for k, v in ObsFeatures(env.observation_space).observations(held.frames).items()}
    actions = torch.as_tensor(held.frames["action"])

    def loss() -> float:
        with torch.no_grad():
            return float(policy.flow_matching_loss(obs, actions, torch.Generator().manual_seed(5)))

    return loss, obs


def expert_return(env, episodes: int = 32, seed: int = 10_000) -> float:
    """The scripted mock/reach expert's mean return on ``env`` over reset seeds ``seed, seed + 1, ...``."""
    from ebrl.demos.experts import mock_reach

    expert, returns = mock_reach(env), []
    for i in range(episodes):
        obs, _ = env.reset(seed=seed + i)
        total, done = 0.0, False
        while not done:
            obs, reward, terminated, truncated, _ = env.step(expert(obs))
            total, done = total + reward, terminated or truncated
        returns.append(total)
    return float(np.mean(returns))


def gap_closed(untrained, policy, make, best: float) -> dict[bool, tuple[float, float, float]]:
    """``{deterministic: (share, before, after)}``: the share of the return gap between
    ``untrained`` and the expert's ``best`` that ``policy`` closes, with its mode and with its
    samples, on 32 reset seeds from 10,000."""
    from ebrl.evaluation import evaluate

    closed = {}
    for deterministic in (True, False):
        before = evaluate(untrained, make(), episodes=32, seed=10_000, deterministic=deterministic).mean_return
        after = evaluate(policy, make(), episodes=32, seed=10_000, deterministic=deterministic).mean_return
        closed[deterministic] = (after - before) / (best - before), before, after
    return closed
