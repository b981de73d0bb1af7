"""Policies: what the runtime calls to act and what algorithms train."""

from ebrl.policies.base import ActResult, Policy
from ebrl.policies.cnn import CNNPolicy
from ebrl.policies.mlp import MLPPolicy

__all__ = ["ActResult", "CNNPolicy", "MLPPolicy", "Policy"]
