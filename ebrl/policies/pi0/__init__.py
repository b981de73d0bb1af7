"""π0 / π0.5 checkpoints as EBRL policies, in three parts:

- :mod:`ebrl.policies.pi0.preprocessing`: what transformers' ``PI0Processor`` does to an
  observation (cameras, state, prompt), as pure functions testable without a model;
- :mod:`ebrl.policies.pi0.policy`: :class:`~ebrl.policies.pi0.policy.PI0Policy`, the model
  adapter: the VLM's prefix once, the action expert as the velocity of
  :mod:`ebrl.policies.flow_chain`'s chain, the noise and value heads, LoRA;
- :mod:`ebrl.policies.pi0.lerobot`: LeRobot's policy folders, read and written.

``ebrl.policies.PI0Policy`` and ``ebrl.policies.from_pretrained`` are the way in:

    >>> from ebrl.policies import PI0Policy
    >>> PI0Policy.__module__
    'ebrl.policies.pi0.policy'
"""
