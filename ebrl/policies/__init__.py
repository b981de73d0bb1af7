"""Policies: what the runtime calls to act and what algorithms train."""

from ebrl.policies.base import ActResult, Policy
from ebrl.policies.cnn import CNNPolicy
from ebrl.policies.encoders import ObsEncoder, ObsLayout
from ebrl.policies.expects import PolicySpaces, check_policy_spaces
from ebrl.policies.flow import FlowPolicy
from ebrl.policies.mlp import MLPPolicy
from ebrl.policies.registry import build_policy, policy_kinds, register_policy, unregister_policy
from ebrl.policies.token import TokenPolicy

__all__ = ["ActResult", "CNNPolicy", "FlowPolicy", "MLPPolicy", "ObsEncoder", "ObsLayout", "Policy", "PolicySpaces",
           "TokenPolicy", "build_policy", "check_policy_spaces", "policy_kinds", "register_policy", "unregister_policy"]
