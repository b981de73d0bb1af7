"""Peer baselines: the same env, policy and PPO driven by plain loops EBRL is measured against."""
