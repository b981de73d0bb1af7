"""SmolVLA, LeRobot's small VLA (about 450M parameters), as a network EBRL samples and trains.

SmolVLA (``lerobot/policies/smolvla/``) is SmolVLM2-500M cut to its first ``num_vlm_layers`` text
layers, which read the cameras (SigLIP tower, pixel-shuffle connector), the prompt and one state
token, plus an action expert: a Llama stack as deep, ``expert_width_multiplier`` times as wide,
whose layers alternate between joint self-attention with the VLM's keys and values and
cross-attention to them (``self_attn_every_n_layers``), denoising a chunk of actions by flow
matching. The package:

- :mod:`~ebrl.policies.smolvla.model`: :class:`SmolVLAModel` (modules named as LeRobot's, so its
  ``state_dict`` is LeRobot's less ``model.``), :class:`SmolVLASettings`, and the split the flow
  chains use: :meth:`SmolVLAModel.prefix_kv` (the VLM once per observation, a :class:`PrefixKV`)
  and :meth:`SmolVLAModel.velocity` (one expert pass, a pure function of the cache, ``x_t``, ``t``);
  ``sample_actions`` (LeRobot's Euler ODE) and ``flow_loss`` (its SFT loss) on top.
- :mod:`~ebrl.policies.smolvla.attention`: the masks, rotary embedding, attention and time
  embedding as SmolVLA defines them (not transformers' versions).
- :mod:`~ebrl.policies.smolvla.preprocess`: cameras resized with padding and mapped to
  ``[-1, 1]``, empty cameras, state padding, the prompt's newline and tokenization.
- :mod:`~ebrl.policies.smolvla.lerobot`: LeRobot's policy folder (``config.json`` of
  ``"type": "smolvla"``, ``model.safetensors`` in LeRobot's names, both processor pipelines with
  their statistics), read with a local SmolVLM folder (``vlm=DIR``) for the VLM's config and
  tokenizer, and written back byte for byte.

- :mod:`~ebrl.policies.smolvla.policy`: :class:`~ebrl.policies.smolvla.policy.SmolVLAPolicy`, the
  RL policy on the shared flow chain (``policy.kind=hf`` with ``policy.vlm=DIR`` loads one).

``ebrl.testing_smolvla.save_random_smolvla`` writes tiny random folders for tests.

    >>> SmolVLASettings().num_vlm_layers, SmolVLASettings().attention_mode
    (16, 'cross_attn')
"""

from ebrl.policies.smolvla.lerobot import SmolVLAFolder, write_smolvla_folder
from ebrl.policies.smolvla.model import PrefixKV, SmolVLAModel, SmolVLASettings

__all__ = ["PrefixKV", "SmolVLAFolder", "SmolVLAModel", "SmolVLASettings", "write_smolvla_folder"]
