"""Your own π0 / π0.5 checkpoint as an EBRL policy, fine-tuned with PPO or GRPO as πRL does.

:class:`PI0Policy` wraps transformers' native ``PI0ForConditionalGeneration`` or
``PI05ForConditionalGeneration`` (``model_type`` ``pi0`` / ``pi05`` in ``config.json`` picks
it), loaded from a local directory with ``local_files_only=True``: ``config.json``, the
weights, the tokenizer and the processor's ``processor_config.json`` (what
``PI0Processor.save_pretrained`` writes). The policy feeds the model exactly what the processor
would (:mod:`ebrl.policies.pi0.preprocessing`): the prompt ``[<image> x tokens per camera]
<bos> text`` (π0: ``text + "\\n"``; π0.5: ``"Task: {task}, State: {256 bins of the
state};\\nAction: "``) right-padded to the processor's
``max_length`` (48 / 200), the cameras resized to fit the image processor's ``size``,
rescaled, normalised and padded, in torch on the model's device (transformers' own
``PI0ImageProcessor`` needs torchvision; its PIL backend is the definition the tests compare
with), and π0's state normalised with the checkpoint's statistics and zero-padded to
``max_state_dim``. The model's actions are un-normalised with the checkpoint's action
statistics, cropped to the env's action dims and clipped to its Box.

**Cameras, state, instruction.** The observation's images (``uint8`` Boxes ``HxWx3``, found by
their spaces as :mod:`ebrl.policies.encoders` finds them, or ``image_keys=``, in that order)
are the cameras, any number and any sizes (transformers' π0 has no fixed camera slots: a
sample's prompt has image tokens for the cameras it has); the other Box entries (or
``state_keys=``) are the state. ``instruction=`` is the task: one string, or a list indexed by
the observation's Discrete ``instruction`` entry (``ebrl train`` passes the env's
``instructions()``).

**The chain** is :mod:`ebrl.policies.flow_chain`'s, in transformers' time (noise at ``t = 1``,
``v = noise - actions``, ``t_k = 1 - k / N`` as ``sample_actions`` computes it): the whole chain
``[x_0 .. x_N]`` (normalised model space, ``[B, N + 1, chunk_size * max_action_dim]``) is the
stored "action", noise and log-prob on the block the env executes (the first ``execute`` actions
of the chunk, the env's ``A`` action dims; the rest follows the ODE, as πRL scores it).
``method`` is ``"flow-noise"`` (the default: a learned noise head, a small MLP on the action
expert's hidden state per action token, giving ``sigma`` in ``[sigma_min, sigma_max]`` as
πRL's ``ExploreNoiseNet``, ``log sigma^2`` interpolated by a ``tanh``; defaults πRL's 0.08 and
0.16), ``"flow-sde"`` (``noise_level``) or ``"ode"`` (``act`` is then ``sample_actions``
itself; nothing to train). PI0Policy supplies the chain its velocity: one action-expert pass
per flow state over the prefix's KV cache.

``act`` returns the chain as ``actions``, its log-prob and the value (``act(obs, noise=x_0)``
starts from given noise, as ``sample_actions(noise=...)``; ``model_inputs(obs)`` is what the
model is fed); ``evaluate(obs, chain)`` recomputes every step's Gaussian with gradients: the VLM
prefix once (its keys and values cached), then ``N`` action-expert passes that read that cache,
each over all the rows.

**Value head** (as RLinf places it): π0's reads the action expert (the mean of its hidden
states over the chunk's tokens; here from one extra expert pass at ``t = 1`` on the zero chunk,
so that the value depends on the observation alone); π0.5's reads the VLM (the mean of the
prefix's last hidden states over its real tokens). A small MLP, zero at the start.
``detach_value_input`` (default: True for π0, False for π0.5, as RLinf's PPO configurations)
keeps the value's gradient out of the model. GRPO ignores the value: ``value_head=False`` then
spares π0 its extra expert pass.

**Training.** With ``lora_rank`` the language model's and the action expert's projections get
LoRA adapters (peft); the action/time projections (``embed_action_time``, with π0's
``state_proj``, and ``action_out_proj``), the noise head and the value head train; every other
weight of the checkpoint stays frozen, and :meth:`trainable_state_dict` is what trains (what
weight publication moves; :func:`~ebrl.policies.base.acting_copy` shares the rest). Without
LoRA everything trains. The model stays in eval mode (no dropout: acting and training compute
one function). ``dtype="bfloat16"`` loads the checkpoint in bfloat16 but keeps the action/time
projections and the heads in float32 and computes log-probs in float32;
``gradient_checkpointing=True`` recomputes the VLM's and the expert's layers in the backward
pass. :meth:`flow_matching_loss` is the model's own flow-matching loss for SFT
(:func:`ebrl.sft.sft`) on demonstration chunks.

Example (a checkpoint directory of your own; nothing is fetched)::

    >>> import gymnasium as gym, numpy as np
    >>> from ebrl.policies.pi0.policy import PI0Policy
    >>> obs_space = gym.spaces.Dict({"image": gym.spaces.Box(0, 255, (224, 224, 3), np.uint8),
    ...                              "wrist": gym.spaces.Box(0, 255, (128, 128, 3), np.uint8),
    ...                              "state": gym.spaces.Box(-np.inf, np.inf, (8,), np.float32)})
    >>> chunk = gym.spaces.Box(-1.0, 1.0, (5, 7))  # execute 5 actions of the chunk per decision
    >>> policy = PI0Policy.from_pretrained(  # doctest: +SKIP
    ...     "/models/pi0-libero", obs_space, chunk, instruction="put the bowl on the plate",
    ...     method="flow-noise", denoise_steps=4, lora_rank=32, dtype="bfloat16")
    >>> out = policy.act({"image": np.zeros((2, 224, 224, 3), np.uint8),  # doctest: +SKIP
    ...                   "wrist": np.zeros((2, 128, 128, 3), np.uint8), "state": np.zeros((2, 8), np.float32)})
    >>> out.actions.shape, out.env_actions.shape  # doctest: +SKIP
    ((2, 5, 1600), (2, 5, 7))
    >>> PI0Policy.from_pretrained("/models/not-there", obs_space, chunk)
    Traceback (most recent call last):
    ...
    FileNotFoundError: PI0Policy: model directory '/models/not-there' does not exist (EBRL loads local ...
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from ebrl.policies.base import ActResult
from ebrl.policies.encoders import ObsEncoder, ObsLayout, as_tensor, lookup
from ebrl.policies.expects import ActionSpec, DType, ObsSpec, PolicySpaces
from ebrl.policies.flow_chain import FlowChain, HasChain, Velocity
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
from ebrl.policies.precision import fast_low_precision_linears
from ebrl.policies.pi0.lerobot import LeRobotFolder, is_lerobot_policy
from ebrl.policies.pi0.preprocessing import (
    IMAGE_TOKEN,
    OWNER,
    PROCESSOR_CONFIG,
    Processing,
    build_prompt,
    check_pi0_dir,
    no_statistics,
    pad_state,
    processor_tokenizer,
    state_bins,
    tokenize_prompts,
)

# ---- the prefix cache: keys and values of the VLM, read by every expert pass -----------------

class PrefixLayer(DynamicLayer):
    """One layer's prefix keys and values. Written once (by the VLM's pass; a gradient
    checkpoint's recompute writes again, which is ignored), then read without growing: every
    expert pass attends to the prefix and its own tokens and no pass sees another's, so nothing
    needs cropping, and the recompute of a checkpointed layer reads what its forward read."""

    def __init__(self, keys: Tensor | None = None, values: Tensor | None = None):
        super().__init__()
        self.read_only = keys is not None
        if keys is not None:
            self.lazy_initialization(keys, values)
            self.keys, self.values = keys, values

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if self.read_only:
            return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states
        return key_states, value_states


class PrefixCache(DynamicCache):
    """The VLM's cache of the prefix (a :class:`PrefixLayer` per layer); :meth:`reader` is the
    view an action-expert pass reads."""

    def __init__(self, layers: list | None = None):
        Cache.__init__(self, layers=layers, layer_class_to_replicate=None if layers else PrefixLayer)

    def reader(self) -> PrefixCache:
        return PrefixCache([PrefixLayer(layer.keys, layer.values) for layer in self.layers])


@dataclasses.dataclass
class Prefix:
    """One pass of the VLM over a batch's prefix."""

    cache: PrefixCache
    mask: Tensor  # [B, L] attention mask (right-padded prompts)
    hidden: Tensor  # [B, L, width] the VLM's last hidden states
    state: Tensor | None  # [B, max_state_dim] π0's normalised, padded state; None for π0.5


# ---- the policy --------------------------------------------------------------------------------

class PI0Policy(HasChain, FrozenModes):
    """A π0 / π0.5 checkpoint's policy (see the module's docstring). Build it with :meth:`from_pretrained`."""

    deterministic: bool = False  # True: act() gives the mode (the ODE from zero noise)
    # PPO's settings for RL from a pretrained or SFT-tuned π0 (ebrl.runs.build_algo applies them under
    # the run's own [ppo] table); docs/policies.md says where they come from
    RL_DEFAULTS: dict[str, Any] = {"lr": 2e-5, "critic_lr": 3e-4, "critic_warmup_updates": 10, "max_kl": 0.02}

    def __init__(self, model: nn.Module, tokenizer: Any, processing: Processing, *,
                 obs_layout: ObsLayout, action_low, action_high, execute: int,
                 instruction: str | Sequence[str] | None = None, instruction_classes: tuple[int, int] | None = None,
                 method: str = "flow-noise", denoise_steps: int | None = None, noise_level: float = 0.5,
                 sigma_min: float = 0.08, sigma_max: float = 0.16, noise_hidden: Sequence[int] = (128, 64),
                 value_head: bool = True, value_hidden: Sequence[int] = (512, 256, 128),
                 detach_value_input: bool | None = None, lora_rank: int | None = None,
                 lora_alpha: float | None = None, lora_targets: Sequence[str] | None = None,
                 gradient_checkpointing: bool = False, dtype: str = "float32", seed: int = 0,
                 base_path: str | None = None):
        super().__init__()
        cfg = model.config
        self.kind = cfg.model_type
        if self.kind not in ("pi0", "pi05"):
            raise ValueError(f"{OWNER}: {type(model).__name__} (model_type {self.kind!r}) is not a π0 or π0.5")
        n = int(denoise_steps if denoise_steps is not None else cfg.num_inference_steps)
        if method == "flow-noise" and not 0 < sigma_min < sigma_max:
            raise ValueError(f"{OWNER}: flow-noise needs 0 < sigma_min < sigma_max, got {sigma_min!r}, {sigma_max!r}")

        low, high = np.asarray(action_low, np.float32), np.asarray(action_high, np.float32)
        self.action_shape = tuple(low.shape)
        self.chunk_size, self.max_action_dim = int(cfg.chunk_size), int(cfg.max_action_dim)
        self.action_dim = int(self.action_shape[-1])
        self.execute = int(execute)
        self.demo_chunk_len = self.chunk_size  # SFT learns whole chunks (ebrl.sft.demo_shape), RL executes `execute`
        if not 1 <= self.execute <= self.chunk_size:
            raise ValueError(f"{OWNER}: execute={execute} actions per decision, but the model's chunks are "
                             f"{self.chunk_size} long")
        if self.action_dim > self.max_action_dim:
            raise ValueError(f"{OWNER}: the env's actions have {self.action_dim} dims, the model's at most "
                             f"{self.max_action_dim}")
        self.action_low, self.action_high = low, high
        try:  # transformers' velocity, over the whole chunk; noise on the block the env executes
            self.chain = FlowChain(n, (self.chunk_size, self.max_action_dim), (self.execute, self.action_dim),
                                   method=method, noise_level=noise_level, noise_at=1)
        except ValueError as e:
            raise ValueError(f"{OWNER}: {e}") from None
        self.noise_level, self.sigma_min, self.sigma_max = float(noise_level), float(sigma_min), float(sigma_max)
        self.seed = int(seed)
        self._layout = obs_layout
        self.instruction_classes = None if instruction_classes is None else tuple(int(v) for v in instruction_classes)
        self.config: dict[str, Any] = {
            "base_path": base_path, "kind": self.kind, "obs_layout": obs_layout.to_config(),
            "action_low": low.tolist(), "action_high": high.tolist(), "execute": self.execute,
            "instruction": instruction if isinstance(instruction, str) or instruction is None else list(instruction),
            "instruction_classes": None if instruction_classes is None else list(instruction_classes),
            "method": method, "denoise_steps": n, "noise_level": self.noise_level, "sigma_min": self.sigma_min,
            "sigma_max": self.sigma_max, "noise_hidden": list(noise_hidden), "value_head": bool(value_head),
            "value_hidden": list(value_hidden), "lora": None, "gradient_checkpointing": bool(gradient_checkpointing),
            "dtype": str(dtype), "seed": self.seed}

        # ---- the processor's settings: statistics, prompt, images
        self.images = processing.images
        vision = cfg.vlm_config.vision_config
        tokens = (int(vision.image_size) // int(vision.patch_size)) ** 2
        if self.images.image_seq_length != tokens:
            raise ValueError(f"{OWNER}: the image processor's image_seq_length is {self.images.image_seq_length}, but "
                             f"the vision tower gives {tokens} tokens per image")
        for e in obs_layout.images:
            _, h, w = e.chw
            out = self.images.output_size(h, w)
            if out != (int(vision.image_size), int(vision.image_size)):
                raise ValueError(f"{OWNER}: camera {e.key!r} ({h}x{w}) becomes {out[0]}x{out[1]} through the image "
                                 f"processor, but the vision tower reads {vision.image_size}x{vision.image_size}")
        state = dataclasses.replace(obs_layout, images=())
        self.state_reader = ObsEncoder(state, normalize=False, owner=OWNER)  # no parameters, no buffers
        self.state_dim = state.flat_dim
        self.max_state_dim, self.bins_padded = int(processing.max_state_dim), bool(processing.bins_padded)
        if self.state_dim > self.max_state_dim:
            raise ValueError(f"{OWNER}: the observation's state has {self.state_dim} elements "
                             f"({[e.key for e in state.entries]}), the model at most {self.max_state_dim}: "
                             "choose the entries with state_keys")
        self._set_norms(processing.state, processing.actions)

        # ---- the tokenizer as the processor leaves it, and the prompts
        self.tokenizer = processor_tokenizer(tokenizer)
        image_id = self.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        if image_id != cfg.vlm_config.image_token_id:
            raise ValueError(f"{OWNER}: the tokenizer's {IMAGE_TOKEN} is id {image_id}, the model's image_token_id "
                             f"{cfg.vlm_config.image_token_id}")
        self.max_length = int(processing.max_length)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.image_prefix = IMAGE_TOKEN * self.images.image_seq_length * len(obs_layout.images)
        self.texts = [""] if instruction is None else [instruction] if isinstance(instruction, str) else [
            str(s) for s in instruction]
        if self.kind == "pi0":  # the prompt does not change with the state: tokenised once per instruction
            ids, mask = self._tokenized(self.texts, None)
            self.register_buffer("prompt_ids", ids, persistent=False)
            self.register_buffer("prompt_mask", mask, persistent=False)
        # where the policy lives (a bool: no dtype cast moves it; not in state_dict)
        self.register_buffer("device_anchor", torch.zeros(0, dtype=torch.bool), persistent=False)

        # ---- the model: dtype, LoRA, checkpointing
        projections = (model.embed_action_time, model.action_out_proj)
        for module in projections:  # they train: float32 whatever the checkpoint's dtype
            module.float()
        fast_low_precision_linears(model)
        if lora_rank is not None:
            targets = tuple(lora_targets) if lora_targets is not None else DEFAULT_LORA_TARGETS
            names = _lora_modules(model, targets)
            alpha = float(lora_alpha if lora_alpha is not None else min(lora_rank, 16))
            self.config["lora"] = {"rank": int(lora_rank), "alpha": alpha, "targets": list(targets)}
            model = wrap_lora(model, int(lora_rank), alpha, names, self.seed)
            for module in projections:
                module.requires_grad_(True)
        self.backbone = model
        if gradient_checkpointing:
            self._enable_checkpointing()
            # the layers only write the prefix cache once and read it after: safe to recompute with it
            hf = self.hf_model
            for layer in (*hf.model.vlm.language_model.layers, *hf.model.dit.layers):
                layer._can_checkpoint_with_cache = True

        # ---- what EBRL adds: the noise head (Flow-Noise) and the value head, float32
        gen = torch.Generator().manual_seed(self.seed)
        width = int(cfg.dit_config.hidden_size)
        if method == "flow-noise":  # small last layer: sigma starts near sqrt(sigma_min * sigma_max)
            self.noise_head = _mlp(width, noise_hidden, self.max_action_dim, nn.Tanh, 0.01, gen)
        self.has_value_head = bool(value_head)
        self.detach_value_input = bool(self.kind == "pi0" if detach_value_input is None else detach_value_input)
        self.config["detach_value_input"] = self.detach_value_input
        if self.has_value_head:  # π0: on the action expert; π0.5: on the VLM (RLinf's value_after_vlm)
            value_in = width if self.kind == "pi0" else int(cfg.vlm_config.text_config.hidden_size)
            self.value_head = _mlp(value_in, value_hidden, 1, nn.ReLU, 0.0, gen)  # values start at 0
        self._start_sampling()
        self.train(True)

    # ---- building ------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path, observation_space, action_space, *,
                        instruction: str | Sequence[str] | None = None, instructions: Sequence[str] | None = None,
                        execute: int | None = None, dtype: str | torch.dtype = "float32",
                        image_keys: Sequence[str] | None = None, state_keys: Sequence[str] | None = None,
                        feature_map: Mapping[str, str] | None = None, tokenizer: str | Path | None = None,
                        **options: Any) -> PI0Policy:
        """Load the π0 / π0.5 checkpoint in the local directory ``path`` for these gymnasium spaces:
        transformers' layout (``config.json`` with ``model_type``, ``processor_config.json``, the
        tokenizer) or a LeRobot policy folder (``config.json`` with ``type``, the processor
        pipelines; :mod:`ebrl.policies.pi0.lerobot`).

        ``observation_space``: cameras (``uint8`` Boxes, ``image_keys`` chooses and orders
        them), state (the other Box entries, or ``state_keys``) and, with a list of
        instructions, the Discrete ``instruction`` entry that picks one per row. A LeRobot
        folder's features name the entries (``observation.images.front`` reads ``front``,
        ``observation.state`` reads ``state``); ``feature_map`` (``{feature: env key}``) says
        otherwise. ``tokenizer``: a local tokenizer directory (a LeRobot folder has none; the
        checkpoint's own otherwise).
        ``action_space``: a Box ``(A,)`` (one action per decision; ``execute=K`` makes it
        ``(K, A)``, which ``ebrl.run`` executes with :class:`~ebrl.envs.chunks.ActionChunk`) or
        ``(K, A)`` with ``K <= chunk_size``: the first ``K`` actions of each chunk are executed
        (πRL's replanning). ``instruction``: the task, or a list of tasks (``instructions`` is
        the same list). ``options``: ``method`` (``"flow-noise"``, ``"flow-sde"``, ``"ode"``),
        ``denoise_steps`` (default the checkpoint's ``num_inference_steps``), ``noise_level``
        (flow-sde, 0.5), ``sigma_min``/``sigma_max`` (flow-noise, 0.08/0.16), ``noise_hidden``,
        ``value_head``, ``value_hidden``, ``detach_value_input``, ``lora_rank``/``lora_alpha``/
        ``lora_targets``, ``gradient_checkpointing``, ``seed``. Local files only: a missing
        file is one :class:`FileNotFoundError` naming it.
        """
        from gymnasium import spaces

        lerobot = is_lerobot_policy(path)
        # first: a wrong path is named before transformers is imported
        folder = LeRobotFolder.read(path) if lerobot else None
        path = folder.path if lerobot else check_pi0_dir(path)
        if feature_map is not None and not lerobot:
            raise ValueError(f"{OWNER}: feature_map renames a LeRobot policy folder's features; {str(path)!r} is in "
                             "transformers' layout: choose the entries with image_keys and state_keys")
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
            low, high = np.broadcast_to(low, (execute, *low.shape)).copy(), np.broadcast_to(high, (execute,
                                                                                                 *high.shape)).copy()
        if folder is not None:
            image_keys, state_keys = folder.env_keys(observation_space, low.shape[-1], feature_map=feature_map,
                                                     image_keys=image_keys, state_keys=state_keys)
        layout, classes = read_spaces(observation_space, instruction, image_keys, state_keys, OWNER, index_only=True)
        if instruction is None:
            warnings.warn(f"{OWNER}: no instruction given: the prompt's task is empty (as PI0Processor without "
                          "text)", stacklevel=2)

        from transformers import AutoConfig, AutoTokenizer, PI0ForConditionalGeneration, PI05ForConditionalGeneration

        torch_type = torch_dtype(dtype, OWNER)
        if folder is not None:
            tok = processor_tokenizer(folder.tokenizer(tokenizer))
            model = folder.load(torch_type, tok.convert_tokens_to_ids(IMAGE_TOKEN))
            processing = Processing(**folder.processing(model.config))
        else:
            config = AutoConfig.from_pretrained(str(path), local_files_only=True)
            model_cls = {"pi0": PI0ForConditionalGeneration, "pi05": PI05ForConditionalGeneration}.get(
                config.model_type)
            if model_cls is None:
                raise ValueError(f"{OWNER}: {str(path)!r} holds a {config.model_type!r} model, not a π0 (pi0) or "
                                 "π0.5 (pi05)")
            model = model_cls.from_pretrained(str(path), local_files_only=True, dtype=torch_type)
            tok = AutoTokenizer.from_pretrained(str(tokenizer or path), local_files_only=True)
            processor_config = json.loads((path / PROCESSOR_CONFIG).read_text())
            if "image_processor" not in processor_config and (path / "preprocessor_config.json").is_file():
                # an older layout: the image processor's settings in a file of their own
                processor_config["image_processor"] = json.loads((path / "preprocessor_config.json").read_text())
            processing = Processing.from_transformers(processor_config, model.config)
        return cls(model, tok, processing, obs_layout=layout, action_low=low, action_high=high,
                   execute=int(execute or 1), instruction=instruction, instruction_classes=classes,
                   dtype=str(dtype).removeprefix("torch."), base_path=str(path.resolve()), **options)

    @classmethod
    def from_spaces(cls, observation_space, action_space, *, path: str | Path, **options: Any) -> PI0Policy:
        """:meth:`from_pretrained` with the spaces first, as the other policies' ``from_spaces``."""
        return cls.from_pretrained(path, observation_space, action_space, **options)

    def _set_norms(self, state: FeatureNorm | None, actions: FeatureNorm) -> None:
        """The checkpoint's state and action normalisation (submodules: they move with the policy)."""
        if state is None:  # no statistics: nothing to normalise, unless the observation has a state
            if self.state_dim:
                raise ValueError(no_statistics(self.kind, "state"))
            state = FeatureNorm(NormalizationMode.IDENTITY)
        if self.state_dim and state.size is not None and state.size != self.state_dim:
            raise ValueError(f"{OWNER}: the checkpoint's state statistics have {state.size} entries, the "
                             f"observation's state {self.state_dim} "
                             f"({[e.key for e in self.state_reader.layout.entries]}): choose the entries with "
                             "state_keys")
        if actions.size is not None and actions.size < self.action_dim:
            raise ValueError(f"{OWNER}: the checkpoint's action statistics have {actions.size} entries, "
                             f"fewer than the env's {self.action_dim} action dims")
        self.state_norm, self.action_norm = state, actions

    # ---- what it is -----------------------------------------------------------------------------

    @property
    def obs_layout(self) -> ObsLayout:
        return self._layout

    @property
    def chain_dim(self) -> int:
        return self.chain.dim

    def expected_spaces(self) -> PolicySpaces:
        """The cameras and state entries read, the Discrete ``instruction`` entry of a list of
        instructions, and Box actions of ``action_shape``."""
        obs = self._layout.expected()
        if self.instruction_classes is not None:
            obs += (ObsSpec(keys=(INSTRUCTION_KEY,), size=self.instruction_classes[0], dtype=DType.CATEGORICAL),)
        return PolicySpaces(obs, ActionSpec(shape=self.action_shape))

    def describe_inputs(self) -> list[dict[str, Any]]:
        """The observation entries read, and how."""
        vision = self.hf_model.config.vlm_config.vision_config.image_size
        out = []
        for e in self._layout.images:
            d = e.describe()
            d["features"] = (f"{type(self.hf_model).__name__} vision tower ({vision}x{vision} after the image "
                             f"processor, {self.images.image_seq_length} tokens)")
            out.append(d)
        for d in self.state_reader.describe():
            if d.get("as") == "ignored" and d["key"] == INSTRUCTION_KEY and self.instruction_classes is not None:
                continue  # read as the instruction index, below
            if d.get("as") != "ignored":
                d["normalised"] = "with the checkpoint's statistics" + (", in the prompt as 256 bins"
                                                                        if self.kind == "pi05" else "")
            out.append(d)
        if self.instruction_classes is not None:
            out.append({"key": INSTRUCTION_KEY, "as": "instruction index", "classes": [self.instruction_classes[0]]})
        return out

    @property
    def _device(self) -> torch.device:
        return self.device_anchor.device

    # ---- the prompt -----------------------------------------------------------------------------

    def _tokenized(self, texts: list[str], bins: list[list[int]] | None) -> tuple[Tensor, Tensor]:
        """The processor's prompts for these instructions (and π0.5's state bins), tokenised."""
        bos = self.tokenizer.bos_token or ""
        prompts = [build_prompt(self.kind, self.image_prefix, bos, text, None if bins is None else bins[r])
                   for r, text in enumerate(texts)]
        return tokenize_prompts(self.tokenizer, prompts, self.max_length, self.pad_id)

    def _rows(self, obs: Any) -> int:
        """The batch size of ``obs``, from its first entry read (or the instruction index)."""
        entry = self._layout.entries[0] if self._layout.entries else None
        value = lookup(obs, entry.path if entry is not None else (INSTRUCTION_KEY,))
        return int(np.prod(np.shape(value))) // max(1, math.prod(entry.shape) if entry is not None else 1)

    # ---- the prefix -----------------------------------------------------------------------------

    def normalized_state(self, obs: Any) -> Tensor | None:
        """The state as the processor normalises it, ``[B, state_dim]`` float32 (None without one)."""
        if not self.state_dim:
            return None
        return self.state_norm.normalize(self.state_reader.vector(obs, self.device_anchor.float()))

    def model_inputs(self, obs: Any) -> dict[str, Tensor]:
        """What the processor would give the model for ``obs``: ``input_ids``, ``attention_mask``,
        ``pixel_values [B, cameras, 3, H, W]``, ``pixel_attention_mask`` and π0's ``state``
        ``[B, max_state_dim]`` (π0.5's is in the prompt), on the policy's device."""
        device = self._device
        state = self.normalized_state(obs)
        rows = state.shape[0] if state is not None else self._rows(obs)
        index = instruction_index(obs, self.instruction_classes, len(self.texts), device, rows)
        if self.kind == "pi0":
            ids, mask = self.prompt_ids[index], self.prompt_mask[index]
            if state is None:
                state = torch.zeros(rows, 0, device=device)
            out = {"state": pad_state(state, self.max_state_dim)}
        else:
            bins = None
            if state is not None:
                bins = state_bins(pad_state(state, self.max_state_dim) if self.bins_padded else state)
            ids, mask = (t.to(device) for t in self._tokenized([self.texts[int(i)] for i in index.tolist()], bins))
            out = {}
        pixels = []
        for e in self._layout.images:
            x = as_tensor(lookup(obs, e.path), device).reshape(-1, *e.shape)
            pixels.append(self.images.preprocess(x if e.channels_first else x.permute(0, 3, 1, 2)))
        if pixels:
            pixel_values = torch.stack(pixels, 1)
        else:  # no camera: one masked slot, which gives no image token
            size = int(self.hf_model.config.vlm_config.vision_config.image_size)
            pixel_values = torch.zeros(rows, 1, 3, size, size, device=device)
        pam = torch.full(pixel_values.shape[:2], bool(pixels), dtype=torch.bool, device=device)
        return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixel_values, "pixel_attention_mask": pam,
                **out}

    def _prefix(self, obs: Any) -> Prefix:
        """The VLM's one pass over the prefix (as ``sample_actions`` runs it), its cache kept."""
        inputs = self.model_inputs(obs)
        hf = self.hf_model
        mask = inputs["attention_mask"]
        vision_dtype = next(hf.model.vlm.vision_tower.parameters()).dtype
        # our cache, filled by the layers (use_cache=False only keeps a checkpointed layer from warning)
        cache = PrefixCache()
        with self._checkpointing():
            embeds = hf.model.embed_prefix(inputs["input_ids"], inputs["pixel_values"].to(vision_dtype),
                                           inputs["pixel_attention_mask"])
            out = hf.model.vlm(inputs_embeds=embeds, attention_mask=mask, position_ids=mask.cumsum(-1) - 1,
                               token_type_ids=torch.zeros_like(mask), use_cache=False, cache=cache)
        return Prefix(cache, mask, out.last_hidden_state, inputs.get("state"))

    # ---- the action expert and the chain --------------------------------------------------------

    def _expert(self, prefix: Prefix, x: Tensor, time: Tensor) -> tuple[Tensor, Tensor]:
        """One action-expert pass (``PI0/PI05ForConditionalGeneration.forward`` on a cached prefix):
        noisy chunks ``x [B, chunk, max_action_dim]`` at times ``time [B]`` -> the velocity and the
        expert's last hidden states over the chunk's tokens, both float32."""
        hf = self.hf_model
        embed = hf.embed_action_time
        expert_dtype = hf.model.dit.layers[0].self_attn.q_proj.weight.dtype
        extra = {}
        if self.kind == "pi0":
            suffix = embed(prefix.state.float(), x.float(), time)
        else:
            suffix, time_embeds = embed(x.float(), time)
            extra["timestep_embeds"] = time_embeds.to(expert_dtype)
        with self._checkpointing():
            out = hf.model(action_embeds=suffix.to(expert_dtype), attention_mask=prefix.mask,
                           cache=prefix.cache.reader(), use_cache=False, **extra)
        hidden = out.last_hidden_state[:, -self.chunk_size:].float()
        return hf.action_out_proj(hidden).float(), hidden

    def _noise_std(self, hidden: Tensor) -> Tensor:
        """Flow-Noise's sigma on the executed block ``[B, execute, A]`` from the expert's hidden
        states: πRL's ExploreNoiseNet, ``log sigma^2`` interpolated by a ``tanh``."""
        unit = torch.tanh(self.noise_head(hidden[:, :self.execute]))[..., :self.action_dim]
        lo, hi = 2 * math.log(self.sigma_min), 2 * math.log(self.sigma_max)
        return torch.exp(0.5 * (lo + (hi - lo) * (unit + 1) / 2))

    def _velocity(self, prefix: Prefix) -> Velocity:
        """The chain's velocity on a cached prefix (transformers' time: noise at ``t = 1``): an
        action-expert pass per flow state, each reading the prefix's cache."""

        def velocity(x: Tensor, t: Tensor) -> tuple[Tensor, Tensor | None]:
            out, sigma = [], []
            for s in range(x.shape[1]):
                v, hidden = self._expert(prefix, x[:, s], t[:, s])
                out.append(v)
                if self.method == "flow-noise":
                    sigma.append(self._noise_std(hidden))
            return torch.stack(out, 1), torch.stack(sigma, 1) if sigma else None

        return velocity

    def step_params(self, obs: Any, x: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """``(mean_k [B, chunk * max_action_dim], sigma_k [B, execute * A])`` of the transition
        from ``x = x_k [B, chunk * max_action_dim]`` at step ``k``, with gradients: the density
        the chain's log-prob is made of (``sigma`` covers the executed block only)."""
        prefix = self._prefix(obs)
        x = torch.as_tensor(x, device=self._device).float()
        return self.chain.step_params(self._velocity(prefix), x, k)

    def _value_features(self, prefix: Prefix) -> Tensor:
        """What the value head reads ``[B, width]``: π0's action expert at ``t = 1`` on the zero
        chunk, π0.5's VLM prefix averaged over its real tokens (RLinf's places)."""
        rows = prefix.mask.shape[0]
        with torch.no_grad() if self.detach_value_input else contextlib.nullcontext():
            if self.kind == "pi0":
                x = torch.zeros(rows, self.chunk_size, self.max_action_dim, device=self._device)
                return self._expert(prefix, x, torch.ones(rows, device=self._device))[1].mean(1)
            m = prefix.mask[..., None].float()
            return (prefix.hidden.float() * m).sum(1) / m.sum(1).clamp(min=1)

    def _values(self, prefix: Prefix) -> Tensor:
        """The value head ``[B]`` (zeros without one), float32."""
        if not self.has_value_head:
            return torch.zeros(prefix.mask.shape[0], device=self._device)
        return self.value_from_features(self._value_features(prefix))

    def value_features(self, obs: Any) -> Tensor:
        """The value head's input for ``obs`` (SFT's value pass computes it once per frame)."""
        return self._value_features(self._prefix(obs))

    def value_from_features(self, features: Tensor) -> Tensor:
        """State values ``[N]`` from :meth:`value_features`."""
        return self.value_head(features.float()).squeeze(-1)

    # ---- acting (runtime) -------------------------------------------------------------------------

    def to_env(self, x: np.ndarray) -> np.ndarray:
        """Final chunks ``[B, chunk * max_action_dim]`` (normalised) -> env actions ``[B, *action_shape]``:
        the first ``execute`` actions un-normalised with the checkpoint's statistics, cropped to
        the env's dims, clipped to the Box."""
        x = torch.as_tensor(np.asarray(x, np.float32)).reshape(-1, self.chunk_size, self.max_action_dim)
        actions = self.action_norm.unnormalize(x[:, :self.execute].to(self._device))[..., :self.action_dim]
        actions = actions.cpu().numpy().reshape(-1, *self.action_shape)
        return np.clip(actions, self.action_low, self.action_high).astype(np.float32)

    @torch.no_grad()
    def act(self, obs: Any, noise: Tensor | np.ndarray | None = None) -> ActResult:
        """Sample chains for ``obs [B, ...]`` (numpy, or a dict of numpy arrays); numpy out.

        ``actions`` is the chain ``[B, N + 1, chunk * max_action_dim]`` (float32, normalised
        model space) the log-prob refers to; ``env_actions`` its last state's executed actions,
        ``[B, *action_shape]`` inside the Box. ``noise`` (``[B, chunk, max_action_dim]``) is
        ``x_0``, ``sample_actions``' ``noise`` (drawn from the policy's stream when None).
        """
        prefix = self._prefix(obs)
        states, logp = self.chain.sample(self._velocity(prefix), prefix.mask.shape[0], self._generator(self._device),
                                         device=self._device, x0=noise, deterministic=self.deterministic)
        actions = states.cpu().numpy()
        return ActResult(actions=actions, env_actions=self.to_env(actions[:, -1]), logprobs=logp.cpu().numpy(),
                         values=self._values(prefix).float().cpu().numpy())

    # ---- training (algorithm) ---------------------------------------------------------------------

    def value(self, obs: Any) -> Tensor:
        """State values ``[N]``, with gradients (unless ``detach_value_input``)."""
        if not self.has_value_head:
            return torch.zeros(self._rows(obs), device=self._device)
        return self._values(self._prefix(obs))

    def evaluate(self, obs: Any, actions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(logprob [M], entropy [M], value [M])`` of stored chains ``actions [M, N + 1, chunk * max_action_dim]``.

        The VLM's prefix once, then ``N`` action-expert passes over all ``M`` rows, reading its
        cache. The entropy is the chain's: ``N(0, I)``'s on the executed block (a constant) plus
        every step's Gaussian's there, given the stored states (constant for flow-sde and the ODE).
        """
        prefix = self._prefix(obs)
        logp, entropy = self.chain.score(self._velocity(prefix), torch.as_tensor(actions, device=self._device).float())
        return logp, entropy, self._values(prefix)

    def flow_matching_loss(self, obs: Any, chunks: Any, generator: torch.Generator | None = None) -> Tensor:
        """The model's own flow-matching loss on demonstration chunks ``[B, K, A]`` (or actions
        ``[B, A]``, K = 1) in env space: the chunks normalised with the checkpoint's statistics
        and zero-padded as the processor does (and, when ``K < chunk_size``, lengthened by
        repeating the last action, as :mod:`ebrl.sft` repeats an episode's last action), time
        ``t`` from the model's Beta distribution, ``x_t = t noise + (1 - t) actions`` and the
        squared error of the predicted velocity against ``noise - actions``, as the model's
        ``forward(actions=...)`` computes it, averaged over the demonstrated entries (the first
        ``K`` actions, the env's ``A`` dims). Trains the model (its adapters under LoRA) and the
        action/time projections; not the noise or value heads.
        """
        prefix = self._prefix(obs)
        device, rows = self._device, prefix.mask.shape[0]
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
                                             sample_time=self._sample_time)

    def _sample_time(self, rows: int, gen: torch.Generator) -> Tensor:
        """The model's training times, ``Beta(alpha, beta) * scale + offset``, drawn from ``gen``."""
        cfg = self.hf_model.config
        alpha, beta = float(cfg.time_sampling_beta_alpha), float(cfg.time_sampling_beta_beta)
        u = torch.rand(rows, generator=gen, device=gen.device).to(self._device)
        if beta == 1.0:  # Beta(alpha, 1): u ** (1 / alpha), by the inverse CDF
            draw = u.pow(1.0 / alpha)
        elif alpha == 1.0:
            draw = 1.0 - u.pow(1.0 / beta)
        else:  # no generator-driven Beta in torch: seed its global stream from the generator
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(int(u[0].item() * 2**31))
                draw = torch.distributions.Beta(alpha, beta).sample((rows,)).to(self._device)
        return (draw * float(cfg.time_sampling_scale) + float(cfg.time_sampling_offset)).float()

    # ---- weights ----------------------------------------------------------------------------------

    def trainable_state_dict(self) -> dict[str, Tensor]:
        """What training changes, named as in ``state_dict()``: the trainable parameters (under
        LoRA the adapters, the action/time projections and the heads; without it, everything)."""
        return {name: t.detach() for name, t in self.state_dict(keep_vars=True).items()
                if isinstance(t, nn.Parameter) and t.requires_grad}


# ---- helpers -----------------------------------------------------------------------------------

def _lora_modules(model: nn.Module, targets: Sequence[str]) -> list[str]:
    """The full names of the language model's and the action expert's linear layers named in
    ``targets`` (the vision tower keeps its weights)."""
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)
             and name.startswith(("model.vlm.language_model.", "model.dit.")) and name.rsplit(".", 1)[-1] in targets]
    if not names:
        raise ValueError(f"{OWNER}: lora_targets {list(targets)} name no linear layer of the language model or the "
                         "action expert")
    return names


__all__ = ["PI0Policy"]
