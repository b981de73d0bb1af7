"""Policies: what the runtime calls to act and what algorithms train.

The kinds that need transformers (``HFTokenPolicy``, ``HFFlowPolicy``, ``PI0Policy``) import it
only when first named here, so a user of the MLP never pays for it.
"""

from ebrl.policies.base import ActResult, Policy
from ebrl.policies.cnn import CNNPolicy
from ebrl.policies.encoders import ObsEncoder, ObsLayout
from ebrl.policies.expects import PolicySpaces, check_policy_spaces
from ebrl.policies.flow import FlowPolicy
from ebrl.policies.mlp import MLPPolicy
from ebrl.policies.registry import (
    build_policy,
    from_pretrained,
    policy_kinds,
    register_policy,
    unregister_policy,
)
from ebrl.policies.token import TokenPolicy

_LAZY = {"HFTokenPolicy": "ebrl.policies.hf_token", "HFFlowPolicy": "ebrl.policies.hf_flow",
         "PI0Policy": "ebrl.policies.pi0.policy"}

__all__ = ["ActResult", "CNNPolicy", "FlowPolicy", "HFFlowPolicy", "HFTokenPolicy", "MLPPolicy", "ObsEncoder",
           "ObsLayout", "PI0Policy", "Policy", "PolicySpaces", "TokenPolicy", "build_policy", "check_policy_spaces",
           "from_pretrained", "policy_kinds", "register_policy", "unregister_policy"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ebrl.policies' has no attribute {name!r}")
