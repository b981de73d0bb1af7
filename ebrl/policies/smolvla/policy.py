"""A LeRobot SmolVLA checkpoint as an EBRL policy, fine-tuned with PPO or GRPO as πRL does.

:class:`SmolVLAPolicy` loads a LeRobot SmolVLA policy folder (:mod:`~ebrl.policies.smolvla.lerobot`:
``config.json``, ``model.safetensors`` in LeRobot's names, both processor pipelines with their
statistics) with a local copy of the SmolVLM it is built on (``vlm=DIR``: the VLM's
``config.json`` and tokenizer; nothing is downloaded) into :class:`~ebrl.policies.smolvla.model.SmolVLAModel`.

**Inputs** exactly as LeRobot's SmolVLA prepares them (:mod:`~ebrl.policies.smolvla.preprocess`):
each camera (``uint8`` frames, ``HxWx3`` or ``3xHxW``) to ``[0, 1]``, resized with padding to
``resize_imgs_with_padding`` and mapped to ``[-1, 1]``, in the config's feature order; a camera
feature the env lacks is an empty, masked image while ``empty_cameras`` allows (``empty_camera_<i>``
included); the state normalised with the preprocessor's statistics and zero-padded to
``max_state_dim``; the task with a newline, tokenized with SmolVLM's tokenizer as the pipeline's
tokenizer step does. The env's entries are found by the features' names (``observation.images.top``
reads ``top``, ``observation.state`` reads ``state``) or ``feature_map``. Two deviations, where
LeRobot would refuse the batch: an env without any camera gives a prefix without image tokens, and
an env without a state gives the zero state.

**Actions**: the chunk's first ``action_dim`` dims un-normalised with the postprocessor's
statistics; the first ``execute`` actions go to the env, clipped to its Box.

**The chain** is :mod:`ebrl.policies.flow_chain`'s in SmolVLA's time (noise at ``t = 1``,
``v = noise - actions``, ``t_k = 1 - k / N`` as ``sample_actions`` computes it): the VLM's keys and
values once per call (:meth:`SmolVLAModel.prefix_kv`), then one expert pass per flow state.
``method`` is ``"flow-noise"`` (a learned noise head on the expert's hidden state per action
token, ``sigma`` in ``[sigma_min, sigma_max]``, πRL's ``ExploreNoiseNet``), ``"flow-sde"``
(``noise_level``) or ``"ode"`` (``sample_actions`` itself). Noise and log-prob are on the executed
block (the first ``execute`` actions, the env's dims).

**Value head**: a float32 MLP (zero at the start) on the mean of the VLM's last hidden states over
the prefix's real tokens, as π0.5's in RLinf (``detach_value_input`` keeps its gradient out of
the model). :meth:`value_features` and :meth:`value_from_features` split it for SFT's value pass.

**Training.** ``lora_rank``: LoRA (peft) on the VLM's text layers and the expert; the state,
action and time projections and the heads train, the rest of the checkpoint stays frozen
(:meth:`trainable_state_dict`). Without LoRA everything trains. ``dtype="bfloat16"`` keeps the
projections and heads in float32; ``gradient_checkpointing`` recomputes each layer in the backward
pass. :meth:`flow_matching_loss` is SmolVLA's own SFT loss (its ``Beta(1.5, 1)`` times) for
:func:`ebrl.sft.sft`. :func:`~ebrl.policies.smolvla.lerobot.save_smolvla_lerobot` writes the trained policy back as a LeRobot
folder (LoRA merged; ``ebrl export RUN --format lerobot``).

Example (folders of your own; nothing is fetched)::

    >>> import gymnasium as gym, numpy as np
    >>> from ebrl.policies.smolvla.policy import SmolVLAPolicy
    >>> obs_space = gym.spaces.Dict({"top": gym.spaces.Box(0, 255, (480, 640, 3), np.uint8),
    ...                              "state": gym.spaces.Box(-np.inf, np.inf, (6,), np.float32)})
    >>> policy = SmolVLAPolicy.from_pretrained(  # doctest: +SKIP
    ...     "/models/smolvla-so100", obs_space, gym.spaces.Box(-1, 1, (6,)), vlm="/models/SmolVLM2-500M",
    ...     instruction="pick up the cube", execute=10, lora_rank=16, dtype="bfloat16")
    >>> SmolVLAPolicy.from_pretrained("/models/not-there", obs_space, gym.spaces.Box(-1, 1, (6,)))
    Traceback (most recent call last):
    ...
    FileNotFoundError: LeRobot policy folder '/models/not-there' does not exist (EBRL loads local ...
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ebrl.policies.encoders import ObsLayout, as_tensor, lookup
from ebrl.policies.hf_backbone import instruction_index, read_spaces, torch_dtype
from ebrl.policies.normalization import FeatureNorm, NormalizationMode
from ebrl.policies.smolvla.lerobot import OBS_IMAGES, SmolVLAFolder
from ebrl.policies.smolvla.model import PrefixKV, SmolVLAModel
from ebrl.policies.smolvla.preprocess import frames_to_unit, pad_vector, prepare_images, tokenize_prompts
from ebrl.policies.vla_flow import VLAFlowPolicy, masked_mean

OWNER = "SmolVLAPolicy"
# the float32 layers around the two stacks: they train under LoRA
PROJECTIONS = ("state_proj", "action_in_proj", "action_out_proj", "action_time_mlp_in", "action_time_mlp_out")


class SmolVLAPolicy(VLAFlowPolicy):
    """A SmolVLA checkpoint's policy (see the module's docstring). Build it with :meth:`from_pretrained`."""

    OWNER = OWNER
    LORA_SCOPE = ("vlm_with_expert.vlm.model.text_model.layers.", "vlm_with_expert.lm_expert.layers.")
    LORA_SCOPE_NAME = "the VLM's text layers or the action expert"

    def __init__(self, model: SmolVLAModel, tokenizer: Any, processing: Mapping[str, Any], *,
                 obs_layout: ObsLayout, camera_features: Sequence[str], detach_value_input: bool = False,
                 lora_rank: int | None = None, lora_alpha: float | None = None,
                 lora_targets: Sequence[str] | None = None, gradient_checkpointing: bool = False, **options: Any):
        """``options``: :class:`~ebrl.policies.vla_flow.VLAFlowPolicy`'s (the action space, the
        instructions, the chain's and the heads' settings, ``dtype``, ``seed``, ``base_path``)."""
        s = model.settings
        super().__init__(chunk=(s.chunk_size, s.max_action_dim), default_steps=s.num_steps, obs_layout=obs_layout,
                         gradient_checkpointing=gradient_checkpointing, camera_features=list(camera_features),
                         **options)

        # ---- the preprocessor's settings
        self.camera_features = tuple(camera_features)
        if len(self.camera_features) != len(obs_layout.images):
            raise ValueError(f"{OWNER}: {len(obs_layout.images)} cameras but {len(self.camera_features)} features")
        self.image_features, self.resize = list(processing["image_features"]), processing["resize"]
        self.empty_cameras = int(processing["empty_cameras"])
        self.max_state_dim, self.max_length = int(processing["max_state_dim"]), int(processing["max_length"])
        self.padding = str(processing["padding"])
        if self.state_dim > self.max_state_dim:
            raise ValueError(f"{OWNER}: the observation's state has {self.state_dim} elements, the model at most "
                             f"{self.max_state_dim}")
        self.state_norm: FeatureNorm = processing["state"] if self.state_dim else FeatureNorm(
            NormalizationMode.IDENTITY)
        self.action_norm: FeatureNorm = processing["actions"]
        self.tokenizer = tokenizer

        # ---- the model: dtype, LoRA, checkpointing
        model.gradient_checkpointing = self.gradient_checkpointing = bool(gradient_checkpointing)
        self.backbone = self._adopt_model(model, [getattr(model, name) for name in PROJECTIONS], lora_rank,
                                          lora_alpha, lora_targets)

        # ---- the noise head on the expert; the value head on the VLM's prefix (RLinf's value_after_vlm)
        self._add_heads(self.hf_model.vlm_with_expert.expert_hidden_size,
                        int(self.hf_model.vlm_with_expert.text_model.config.hidden_size), detach_value_input)

    # ---- building ------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path, observation_space, action_space, *, vlm: str | Path | None = None,
                        instruction: str | Sequence[str] | None = None, instructions: Sequence[str] | None = None,
                        feature_map: Mapping[str, str] | None = None, execute: int | None = None,
                        dtype: str | torch.dtype = "float32", **options: Any) -> SmolVLAPolicy:
        """Load the LeRobot SmolVLA folder ``path`` for these gymnasium spaces, with ``vlm`` the
        local directory of the SmolVLM it is built on (its ``config.json`` and tokenizer).

        ``observation_space``: a Dict whose cameras and state the folder's features name (or
        ``feature_map``, ``{feature: env key}``) and, with a list of instructions, the Discrete
        ``instruction`` entry picking one per row. ``action_space``: a Box ``(A,)`` (``execute=K``
        makes the decisions chunks ``(K, A)``, which ``ebrl.run`` executes with ActionChunk) or
        ``(K, A)``. ``options``: ``method``, ``denoise_steps`` (default the folder's
        ``num_steps``), ``noise_level``, ``sigma_min``/``sigma_max``, ``noise_hidden``,
        ``value_head``, ``value_hidden``, ``detach_value_input``, ``lora_rank``/``lora_alpha``/
        ``lora_targets``, ``gradient_checkpointing``, ``seed``. Local files only: a missing file
        is one :class:`FileNotFoundError` naming it."""
        folder = SmolVLAFolder.read(path)  # first: a wrong path is named before anything loads
        folder.vlm_dir(vlm)
        if folder.config.get("adapt_to_pi_aloha"):
            raise NotImplementedError(f"{folder.path}: adapt_to_pi_aloha=True (ALOHA's joint conversions) is not "
                                      "supported")
        instruction = cls.instruction_option(instruction, instructions)
        low, high, execute = cls.action_bounds(action_space, execute)
        image_keys, state_keys = folder.env_keys(observation_space, low.shape[-1], feature_map=feature_map)
        layout, classes = read_spaces(observation_space, instruction, image_keys, state_keys, OWNER, index_only=True)
        if instruction is None:
            warnings.warn(f"{OWNER}: no instruction given: the prompt's task is empty", stacklevel=2)
        tokenizer = folder.tokenizer(vlm)
        model = folder.load_model(vlm, torch_dtype(dtype, OWNER))
        return cls(model, tokenizer, folder.processing(), obs_layout=layout,
                   camera_features=_camera_features(folder, image_keys, feature_map), action_low=low,
                   action_high=high, execute=execute, instruction=instruction, instruction_classes=classes,
                   dtype=str(dtype).removeprefix("torch."), base_path=str(folder.path.resolve()), **options)

    def _describe_camera(self, i: int) -> str:
        return f"SmolVLA's {self.camera_features[i]} (resized with padding to {self.resize})"

    # ---- the prefix -----------------------------------------------------------------------------

    def model_inputs(self, obs: Any) -> dict[str, Any]:
        """What LeRobot's SmolVLA feeds ``sample_actions`` for ``obs``: ``images`` and
        ``img_masks`` (lists, one per camera read), ``lang_tokens``, ``lang_masks`` and ``state``
        ``[B, max_state_dim]`` (normalised, padded), on the policy's device."""
        device = self._device
        rows = self._rows(obs)
        frames = {}
        for e, feature in zip(self._layout.images, self.camera_features):
            x = as_tensor(lookup(obs, e.path), device).reshape(-1, *e.shape)
            frames[feature] = frames_to_unit(x if e.channels_first else x.permute(0, 3, 1, 2))
        images, masks = prepare_images(frames, self.image_features, resize=self.resize,
                                       empty_cameras=self.empty_cameras) if frames else ([], [])
        if self.state_dim:
            state = self.state_norm.normalize(self.state_reader.vector(obs, self.device_anchor.float()))
        else:  # LeRobot's SmolVLA needs a state: the zero state
            state = torch.zeros(rows, 0, device=device)
        index = instruction_index(obs, self.instruction_classes, len(self.texts), device, rows)
        tokens, lang_masks = tokenize_prompts(self.tokenizer, [self.texts[int(i)] for i in index.tolist()],
                                              max_length=self.max_length, padding=self.padding)
        return {"images": images, "img_masks": masks, "lang_tokens": tokens.to(device),
                "lang_masks": lang_masks.to(device), "state": pad_vector(state, self.max_state_dim)}

    def _prefix(self, obs: Any, *, last_hidden: bool | None = None) -> PrefixKV:
        """The VLM's one pass over the prefix, its keys and values kept (and its last hidden
        states for the value head)."""
        with_hidden = self.has_value_head if last_hidden is None else last_hidden
        return self.hf_model.prefix_kv(**self.model_inputs(obs), last_hidden=with_hidden)

    # ---- the action expert and the chain --------------------------------------------------------

    def _expert(self, prefix: PrefixKV, x: Tensor, time: Tensor) -> tuple[Tensor, Tensor]:
        """One expert pass (as :meth:`SmolVLAModel.velocity`): the velocity and the expert's last
        hidden states over the chunk, float32."""
        model = self.hf_model
        hidden = model.expert_hidden(prefix, x, time).to(torch.float32)
        return model.action_out_proj(hidden), hidden

    # ---- the value ------------------------------------------------------------------------------

    def _features(self, prefix: PrefixKV) -> Tensor:
        """The value head's input ``[B, width]``: the VLM's last hidden states averaged over the
        prefix's real tokens, float32."""
        return masked_mean(prefix.hidden, prefix.pad_masks)

    def _sample_time(self, rows: int, gen: torch.Generator) -> Tensor:
        """LeRobot's SmolVLA training times, ``Beta(1.5, 1) * 0.999 + 0.001``, drawn from ``gen`` by
        the inverse CDF (``u ** (1 / 1.5)``)."""
        u = torch.rand(rows, generator=gen, device=gen.device)
        return u.pow(1.0 / 1.5) * 0.999 + 0.001


# ---- helpers -----------------------------------------------------------------------------------

def _camera_features(folder: SmolVLAFolder, image_keys: Sequence[str], feature_map: Mapping[str, str] | None
                     ) -> list[str]:
    """The feature each env camera in ``image_keys`` fills (as :meth:`SmolVLAFolder.env_keys` matched them)."""
    fmap, by_key = dict(feature_map or {}), {}
    for feature in folder.cameras():
        by_key.setdefault(fmap.get(feature, feature.removeprefix(f"{OBS_IMAGES}.")), feature)
        by_key.setdefault(feature, feature)
    return [by_key[key] for key in image_keys]


__all__ = ["SmolVLAPolicy"]
