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

import contextlib
import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor, nn

from ebrl.policies.base import ActResult
from ebrl.policies.encoders import ObsEncoder, ObsLayout, as_tensor, lookup
from ebrl.policies.flow_chain import FlowChain, HasChain, Velocity, tanh_sigma
from ebrl.policies.hf_backbone import (
    DEFAULT_LORA_TARGETS,
    INSTRUCTION_KEY,
    FrozenModes,
    instruction_index,
    read_spaces,
    torch_dtype,
    wrap_lora,
)
from ebrl.policies.mlp import _mlp
from ebrl.policies.normalization import FeatureNorm, NormalizationMode
from ebrl.policies.pi0.policy import PI0Policy
from ebrl.policies.precision import fast_low_precision_linears
from ebrl.policies.smolvla.lerobot import OBS_IMAGES, SmolVLAFolder
from ebrl.policies.smolvla.model import PrefixKV, SmolVLAModel
from ebrl.policies.smolvla.preprocess import frames_to_unit, pad_vector, prepare_images, tokenize_prompts

OWNER = "SmolVLAPolicy"
# the float32 layers around the two stacks: they train under LoRA
PROJECTIONS = ("state_proj", "action_in_proj", "action_out_proj", "action_time_mlp_in", "action_time_mlp_out")
LORA_SCOPE = ("vlm_with_expert.vlm.model.text_model.layers.", "vlm_with_expert.lm_expert.layers.")


class SmolVLAPolicy(HasChain, FrozenModes):
    """A SmolVLA checkpoint's policy (see the module's docstring). Build it with :meth:`from_pretrained`."""

    deterministic: bool = False  # True: act() gives the mode (the ODE from zero noise)
    # PPO's settings for RL from a pretrained or SFT-tuned VLA, PI0Policy's (ebrl.runs.build_algo applies them)
    RL_DEFAULTS: ClassVar[dict[str, Any]] = PI0Policy.RL_DEFAULTS

    def __init__(self, model: SmolVLAModel, tokenizer: Any, processing: Mapping[str, Any], *,
                 obs_layout: ObsLayout, camera_features: Sequence[str], action_low, action_high, execute: int,
                 instruction: str | Sequence[str] | None = None, instruction_classes: tuple[int, int] | None = None,
                 method: str = "flow-noise", denoise_steps: int | None = None, noise_level: float = 0.5,
                 sigma_min: float = 0.08, sigma_max: float = 0.16, noise_hidden: Sequence[int] = (128, 64),
                 value_head: bool = True, value_hidden: Sequence[int] = (512, 256, 128),
                 detach_value_input: bool = False, lora_rank: int | None = None, lora_alpha: float | None = None,
                 lora_targets: Sequence[str] | None = None, gradient_checkpointing: bool = False,
                 dtype: str = "float32", seed: int = 0, base_path: str | None = None):
        super().__init__()
        s = model.settings
        n = int(denoise_steps if denoise_steps is not None else s.num_steps)
        if method == "flow-noise" and not 0 < sigma_min < sigma_max:
            raise ValueError(f"{OWNER}: flow-noise needs 0 < sigma_min < sigma_max, got {sigma_min!r}, {sigma_max!r}")
        low, high = np.asarray(action_low, np.float32), np.asarray(action_high, np.float32)
        self.action_shape = tuple(low.shape)
        self.chunk_size, self.max_action_dim = int(s.chunk_size), int(s.max_action_dim)
        self.action_dim, self.execute = int(self.action_shape[-1]), int(execute)
        self.demo_chunk_len = self.chunk_size  # SFT learns whole chunks (ebrl.sft.demo_shape), RL executes `execute`
        if not 1 <= self.execute <= self.chunk_size:
            raise ValueError(f"{OWNER}: execute={execute} actions per decision, but the model's chunks are "
                             f"{self.chunk_size} long")
        if self.action_dim > self.max_action_dim:
            raise ValueError(f"{OWNER}: the env's actions have {self.action_dim} dims, the model's at most "
                             f"{self.max_action_dim}")
        self.action_low, self.action_high = low, high
        try:  # SmolVLA's velocity over the whole chunk; noise on the block the env executes
            self.chain = FlowChain(n, (self.chunk_size, self.max_action_dim), (self.execute, self.action_dim),
                                   method=method, noise_level=noise_level, noise_at=1)
        except ValueError as e:
            raise ValueError(f"{OWNER}: {e}") from None
        self.noise_level, self.sigma_min, self.sigma_max = float(noise_level), float(sigma_min), float(sigma_max)
        self.seed = int(seed)
        self._layout = obs_layout
        self.instruction_classes = None if instruction_classes is None else tuple(int(v) for v in instruction_classes)
        self.config: dict[str, Any] = {
            "base_path": base_path, "obs_layout": obs_layout.to_config(), "camera_features": list(camera_features),
            "action_low": low.tolist(), "action_high": high.tolist(), "execute": self.execute,
            "instruction": instruction if isinstance(instruction, str) or instruction is None else list(instruction),
            "instruction_classes": None if instruction_classes is None else list(instruction_classes),
            "method": method, "denoise_steps": n, "noise_level": self.noise_level, "sigma_min": self.sigma_min,
            "sigma_max": self.sigma_max, "noise_hidden": list(noise_hidden), "value_head": bool(value_head),
            "value_hidden": list(value_hidden), "detach_value_input": bool(detach_value_input), "lora": None,
            "gradient_checkpointing": bool(gradient_checkpointing), "dtype": str(dtype), "seed": self.seed}

        # ---- the preprocessor's settings
        self.camera_features = tuple(camera_features)
        if len(self.camera_features) != len(obs_layout.images):
            raise ValueError(f"{OWNER}: {len(obs_layout.images)} cameras but {len(self.camera_features)} features")
        self.image_features, self.resize = list(processing["image_features"]), processing["resize"]
        self.empty_cameras = int(processing["empty_cameras"])
        self.max_state_dim, self.max_length = int(processing["max_state_dim"]), int(processing["max_length"])
        self.padding = str(processing["padding"])
        state = dataclasses.replace(obs_layout, images=())
        self.state_reader = ObsEncoder(state, normalize=False, owner=OWNER)  # no parameters, no buffers
        self.state_dim = state.flat_dim
        if self.state_dim > self.max_state_dim:
            raise ValueError(f"{OWNER}: the observation's state has {self.state_dim} elements, the model at most "
                             f"{self.max_state_dim}")
        self.state_norm: FeatureNorm = processing["state"] if self.state_dim else FeatureNorm(
            NormalizationMode.IDENTITY)
        self.action_norm: FeatureNorm = processing["actions"]
        self.tokenizer = tokenizer
        self.texts = [""] if instruction is None else [instruction] if isinstance(instruction, str) else [
            str(t) for t in instruction]
        # where the policy lives (a bool: no dtype cast moves it; not in state_dict)
        self.register_buffer("device_anchor", torch.zeros(0, dtype=torch.bool), persistent=False)

        # ---- the model: dtype, LoRA, checkpointing
        projections = [getattr(model, name) for name in PROJECTIONS]
        for module in projections:  # they train: float32 whatever the checkpoint's dtype
            module.float()
        fast_low_precision_linears(model)
        model.gradient_checkpointing = self.gradient_checkpointing = bool(gradient_checkpointing)
        if lora_rank is not None:
            targets = tuple(lora_targets) if lora_targets is not None else DEFAULT_LORA_TARGETS
            alpha = float(lora_alpha if lora_alpha is not None else min(lora_rank, 16))
            self.config["lora"] = {"rank": int(lora_rank), "alpha": alpha, "targets": list(targets)}
            model = wrap_lora(model, int(lora_rank), alpha, _lora_modules(model, targets), self.seed)
            for module in projections:
                module.requires_grad_(True)
        self.backbone = model

        # ---- what EBRL adds: the noise head (Flow-Noise) and the value head, float32
        gen = torch.Generator().manual_seed(self.seed)
        if method == "flow-noise":  # small last layer: sigma starts near sqrt(sigma_min * sigma_max)
            width = self.hf_model.vlm_with_expert.expert_hidden_size
            self.noise_head = _mlp(width, noise_hidden, self.max_action_dim, nn.Tanh, 0.01, gen)
        self.has_value_head, self.detach_value_input = bool(value_head), bool(detach_value_input)
        if self.has_value_head:  # on the VLM's prefix (RLinf's value_after_vlm), values start at 0
            width = int(self.hf_model.vlm_with_expert.text_model.config.hidden_size)
            self.value_head = _mlp(width, value_hidden, 1, nn.ReLU, 0.0, gen)
        self._start_sampling()
        self.train(True)

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
        from gymnasium import spaces

        folder = SmolVLAFolder.read(path)  # first: a wrong path is named before anything loads
        folder.vlm_dir(vlm)
        if folder.config.get("adapt_to_pi_aloha"):
            raise NotImplementedError(f"{folder.path}: adapt_to_pi_aloha=True (ALOHA's joint conversions) is not "
                                      "supported")
        if instructions is not None:
            if instruction is not None:
                raise ValueError(f"{OWNER}: give instruction= or instructions=, not both")
            instruction = list(instructions)
        if not (isinstance(action_space, spaces.Box) and len(action_space.shape) in (1, 2)):
            raise ValueError(f"{OWNER} needs a Box action space of shape (A,) or (K, A), got {action_space!r}")
        low, high = np.asarray(action_space.low, np.float32), np.asarray(action_space.high, np.float32)
        if low.ndim == 2:
            if execute is not None and execute != low.shape[0]:
                raise ValueError(f"{OWNER}: the action space executes chunks of {low.shape[0]} actions, not "
                                 f"execute={execute}")
            execute = low.shape[0]
        elif execute is not None and execute != 1:  # chunks of `execute` actions of this Box (ActionChunk)
            low = np.broadcast_to(low, (execute, *low.shape)).copy()
            high = np.broadcast_to(high, (execute, *high.shape)).copy()
        image_keys, state_keys = folder.env_keys(observation_space, low.shape[-1], feature_map=feature_map)
        layout, classes = read_spaces(observation_space, instruction, image_keys, state_keys, OWNER, index_only=True)
        if instruction is None:
            warnings.warn(f"{OWNER}: no instruction given: the prompt's task is empty", stacklevel=2)
        tokenizer = folder.tokenizer(vlm)
        model = folder.load_model(vlm, torch_dtype(dtype, OWNER))
        return cls(model, tokenizer, folder.processing(), obs_layout=layout,
                   camera_features=_camera_features(folder, image_keys, feature_map), action_low=low,
                   action_high=high, execute=int(execute or 1), instruction=instruction, instruction_classes=classes,
                   dtype=str(dtype).removeprefix("torch."), base_path=str(folder.path.resolve()), **options)

    @classmethod
    def from_spaces(cls, observation_space, action_space, *, path: str | Path, **options: Any) -> SmolVLAPolicy:
        """:meth:`from_pretrained` with the spaces first, as the other policies' ``from_spaces``."""
        return cls.from_pretrained(path, observation_space, action_space, **options)

    # ---- what it is -----------------------------------------------------------------------------

    # PI0Policy's generic pieces, as they are: they read only the layout, the chain and the action shape
    obs_layout = PI0Policy.obs_layout
    chain_dim = PI0Policy.chain_dim
    _device = PI0Policy._device
    expected_spaces = PI0Policy.expected_spaces
    _rows = PI0Policy._rows
    trainable_state_dict = PI0Policy.trainable_state_dict

    def describe_inputs(self) -> list[dict[str, Any]]:
        """The observation entries read, and how."""
        out = []
        for e, feature in zip(self._layout.images, self.camera_features):
            d = e.describe()
            d["features"] = f"SmolVLA's {feature} (resized with padding to {self.resize})"
            out.append(d)
        for d in self.state_reader.describe():
            if d.get("as") == "ignored" and d["key"] == INSTRUCTION_KEY and self.instruction_classes is not None:
                continue  # read as the instruction index, below
            if d.get("as") != "ignored":
                d["normalised"] = "with the checkpoint's statistics"
            out.append(d)
        if self.instruction_classes is not None:
            out.append({"key": INSTRUCTION_KEY, "as": "instruction index", "classes": [self.instruction_classes[0]]})
        return out

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

    def _velocity(self, prefix: PrefixKV) -> Velocity:
        """The chain's velocity on a cached prefix (SmolVLA's time: noise at ``t = 1``): an expert
        pass per flow state, as :meth:`SmolVLAModel.velocity`, and Flow-Noise's sigma from the
        same hidden states."""
        model = self.hf_model

        def velocity(x: Tensor, t: Tensor) -> tuple[Tensor, Tensor | None]:
            out, sigma = [], []
            for s in range(x.shape[1]):
                hidden = model.expert_hidden(prefix, x[:, s], t[:, s]).to(torch.float32)
                out.append(model.action_out_proj(hidden))
                if self.method == "flow-noise":
                    raw = self.noise_head(hidden[:, :self.execute])[..., :self.action_dim]
                    sigma.append(tanh_sigma(raw, self.sigma_min, self.sigma_max))
            return torch.stack(out, 1), torch.stack(sigma, 1) if sigma else None

        return velocity

    def step_params(self, obs: Any, x: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """``(mean_k [B, chunk * max_action_dim], sigma_k [B, execute * A])`` of the transition
        from ``x = x_k`` at step ``k``, with gradients."""
        prefix = self._prefix(obs, last_hidden=False)
        x = torch.as_tensor(x, device=self._device).float()
        return self.chain.step_params(self._velocity(prefix), x, k)

    # ---- the value ------------------------------------------------------------------------------

    def _features(self, prefix: PrefixKV) -> Tensor:
        """The value head's input ``[B, width]``: the VLM's last hidden states averaged over the
        prefix's real tokens, float32."""
        m = prefix.pad_masks[..., None].float()
        return (prefix.hidden.float() * m).sum(1) / m.sum(1).clamp(min=1)

    def _values(self, prefix: PrefixKV) -> Tensor:
        if not self.has_value_head:
            return torch.zeros(prefix.pad_masks.shape[0], device=self._device)
        with torch.no_grad() if self.detach_value_input else contextlib.nullcontext():
            features = self._features(prefix)
        return self.value_from_features(features)

    def value_features(self, obs: Any) -> Tensor:
        """What the value head reads for ``obs``, ``[N, width]`` (SFT's value pass computes it once per frame)."""
        return self._features(self._prefix(obs, last_hidden=True))

    def value_from_features(self, features: Tensor) -> Tensor:
        """The value head on :meth:`value_features`' output: ``[N]``."""
        if not self.has_value_head:
            return torch.zeros(features.shape[0], device=self._device)
        return self.value_head(features.float()).squeeze(-1)

    def value(self, obs: Any) -> Tensor:
        """State values ``[N]``, with gradients (unless ``detach_value_input``)."""
        if not self.has_value_head:
            return torch.zeros(self._rows(obs), device=self._device)
        return self._values(self._prefix(obs))

    # ---- acting (runtime) -------------------------------------------------------------------------

    def to_env(self, x: np.ndarray) -> np.ndarray:
        """Final chunks ``[B, chunk * max_action_dim]`` (normalised) -> env actions ``[B, *action_shape]``:
        the first ``execute`` actions, cropped to the env's dims, un-normalised with the
        checkpoint's statistics (LeRobot's order), clipped to the Box."""
        x = torch.as_tensor(np.asarray(x, np.float32)).reshape(-1, self.chunk_size, self.max_action_dim)
        actions = self.action_norm.unnormalize(x[:, :self.execute, :self.action_dim].to(self._device))
        actions = actions.cpu().numpy().reshape(-1, *self.action_shape)
        return np.clip(actions, self.action_low, self.action_high).astype(np.float32)

    @torch.no_grad()
    def act(self, obs: Any, noise: Tensor | np.ndarray | None = None) -> ActResult:
        """Sample chains for ``obs [B, ...]``; numpy out. ``actions`` is the chain ``[B, N + 1,
        chunk * max_action_dim]`` the log-prob refers to; ``env_actions`` its last state's
        executed actions. ``noise`` (``[B, chunk, max_action_dim]``) is ``sample_actions``' noise."""
        prefix = self._prefix(obs)
        states, logp = self.chain.sample(self._velocity(prefix), prefix.pad_masks.shape[0],
                                         self._generator(self._device), device=self._device, x0=noise,
                                         deterministic=self.deterministic)
        actions = states.cpu().numpy()
        return ActResult(actions=actions, env_actions=self.to_env(actions[:, -1]), logprobs=logp.cpu().numpy(),
                         values=self._values(prefix).float().cpu().numpy())

    # ---- training (algorithm) ---------------------------------------------------------------------

    def evaluate(self, obs: Any, actions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(logprob [M], entropy [M], value [M])`` of stored chains ``[M, N + 1, chunk * max_action_dim]``:
        the VLM's prefix once, then ``N`` expert passes over all ``M`` rows."""
        prefix = self._prefix(obs)
        logp, entropy = self.chain.score(self._velocity(prefix), torch.as_tensor(actions, device=self._device).float())
        return logp, entropy, self._values(prefix)

    def flow_matching_loss(self, obs: Any, chunks: Any, generator: torch.Generator | None = None) -> Tensor:
        """SmolVLA's flow-matching loss on demonstration chunks ``[B, K, A]`` (or actions
        ``[B, A]``) in env units: normalised with the checkpoint's statistics, zero-padded to
        ``max_action_dim`` (and, when ``K < chunk_size``, lengthened by repeating the last action,
        as :mod:`ebrl.sft` does), times from ``Beta(1.5, 1) * 0.999 + 0.001`` as LeRobot's
        ``sample_time``, averaged over the demonstrated entries (LeRobot also averages the padded
        dims, a constant factor). Trains the model (its adapters under LoRA) and the projections."""
        prefix = self._prefix(obs, last_hidden=False)
        device, rows = self._device, prefix.pad_masks.shape[0]
        a = as_tensor(chunks, device).float()
        a = a.reshape(rows, -1, a.shape[-1])
        k, dims = a.shape[1], a.shape[2]
        if k > self.chunk_size or dims != self.action_dim:
            raise ValueError(f"{OWNER}.flow_matching_loss: chunks of {k} actions of {dims} dims, but the model's "
                             f"chunks are {self.chunk_size} long and the env's actions {self.action_dim} dims")
        target = torch.zeros(rows, self.chunk_size, self.max_action_dim, device=device)
        normalised = self.action_norm.normalize(a)
        target[:, :k, :dims] = normalised
        target[:, k:, :dims] = normalised[:, -1:]
        gen = generator if generator is not None else self._generator(device)
        return self.chain.flow_matching_loss(self._velocity(prefix), target, gen, scored=(k, dims),
                                             sample_time=_sample_time)

# ---- helpers -----------------------------------------------------------------------------------

def _sample_time(rows: int, gen: torch.Generator) -> Tensor:
    """LeRobot's SmolVLA training times, ``Beta(1.5, 1) * 0.999 + 0.001``, drawn from ``gen`` by
    the inverse CDF (``u ** (1 / 1.5)``)."""
    u = torch.rand(rows, generator=gen, device=gen.device)
    return u.pow(1.0 / 1.5) * 0.999 + 0.001


def _camera_features(folder: SmolVLAFolder, image_keys: Sequence[str], feature_map: Mapping[str, str] | None
                     ) -> list[str]:
    """The feature each env camera in ``image_keys`` fills (as :meth:`SmolVLAFolder.env_keys` matched them)."""
    fmap, by_key = dict(feature_map or {}), {}
    for feature in folder.cameras():
        by_key.setdefault(fmap.get(feature, feature.removeprefix(f"{OBS_IMAGES}.")), feature)
        by_key.setdefault(feature, feature)
    return [by_key[key] for key in image_keys]


def _lora_modules(model: nn.Module, targets: Sequence[str]) -> list[str]:
    """The full names of the VLM's text layers' and the expert's linear layers named in
    ``targets`` (the vision tower keeps its weights)."""
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)
             and name.startswith(LORA_SCOPE) and name.rsplit(".", 1)[-1] in targets]
    if not names:
        raise ValueError(f"{OWNER}: lora_targets {list(targets)} name no linear layer of the VLM's text layers or "
                         "the action expert")
    return names


__all__ = ["SmolVLAPolicy"]
