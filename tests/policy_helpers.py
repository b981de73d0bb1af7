"""What the policy tests read from inside a policy to check its log-probs by hand: one step of a
flow chain (tests/test_flow_policy.py, test_hf_flow.py, test_pi0.py, test_smolvla_policy.py) and
the teacher-forced logits of a token policy (tests/test_token_policy.py, test_hf_token.py,
test_adaptive_lr.py). ``evaluate`` computes both inside and returns only their sums."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ebrl.policies.flow import FlowPolicy
from ebrl.policies.hf_flow import HFFlowPolicy
from ebrl.policies.hf_token import HFTokenPolicy
from ebrl.policies.vla_flow import VLAFlowPolicy


def step_params(policy: FlowPolicy | HFFlowPolicy | VLAFlowPolicy, obs: Any, x: Tensor,
                k: int) -> tuple[Tensor, Tensor]:
    """``(mean_k, sigma_k)`` of ``policy``'s chain step ``k`` from ``x = x_k [N, K * A]`` on ``obs``,
    with gradients: the Gaussians the chain's log-prob is made of (a VLA's ``sigma`` covers the
    executed block only)."""
    if isinstance(policy, FlowPolicy):
        feat = policy._features(obs)
        return policy.chain.step_params(policy._velocity(feat), x.to(feat.dtype), k)
    if isinstance(policy, HFFlowPolicy):
        memory, padding, _ = policy._read_prefix(obs)
        return policy.chain.step_params(policy._velocity(memory, padding),
                                        torch.as_tensor(x, device=memory.device).float(), k)
    velocity = policy._velocity(policy._prefix(obs, last_hidden=False))
    return policy.chain.step_params(velocity, torch.as_tensor(x, device=policy._device).float(), k)


def token_logits(policy, obs: Any, actions: Any) -> tuple[Tensor, Tensor]:
    """A :class:`~ebrl.policies.token.TokenPolicy`'s or :class:`HFTokenPolicy`'s teacher-forced
    logits ``[N, D, bins]`` of every action dimension given the earlier ones of ``actions
    [N, *action_shape]``, and its values ``[N]``: the full pass ``evaluate`` makes, with gradients."""
    ids = policy._bin_ids(actions) if isinstance(policy, HFTokenPolicy) else policy._token_ids(actions)
    return policy._logits(obs, ids)
