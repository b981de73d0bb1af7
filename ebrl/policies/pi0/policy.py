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

import dataclasses
import json
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from ebrl.policies.encoders import ObsLayout, as_tensor, lookup
from ebrl.policies.hf_backbone import instruction_index, read_spaces, torch_dtype
from ebrl.policies.normalization import FeatureNorm, NormalizationMode
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
from ebrl.policies.vla_flow import VLAFlowPolicy, masked_mean

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

    @property
    def rows(self) -> int:
        return self.mask.shape[0]


# ---- the policy --------------------------------------------------------------------------------

class PI0Policy(VLAFlowPolicy):
    """A π0 / π0.5 checkpoint's policy (see the module's docstring). Build it with :meth:`from_pretrained`."""

    OWNER = OWNER
    LORA_SCOPE = ("model.vlm.language_model.", "model.dit.")
    LORA_SCOPE_NAME = "the language model or the action expert"

    def __init__(self, model: nn.Module, tokenizer: Any, processing: Processing, *, obs_layout: ObsLayout,
                 detach_value_input: bool | None = None, lora_rank: int | None = None,
                 lora_alpha: float | None = None, lora_targets: Sequence[str] | None = None,
                 gradient_checkpointing: bool = False, **options: Any):
        """``options``: :class:`~ebrl.policies.vla_flow.VLAFlowPolicy`'s (the action space, the
        instructions, the chain's and the heads' settings, ``dtype``, ``seed``, ``base_path``)."""
        cfg = model.config
        kind = cfg.model_type
        if kind not in ("pi0", "pi05"):
            raise ValueError(f"{OWNER}: {type(model).__name__} (model_type {kind!r}) is not a π0 or π0.5")
        super().__init__(chunk=(cfg.chunk_size, cfg.max_action_dim), default_steps=cfg.num_inference_steps,
                         obs_layout=obs_layout, gradient_checkpointing=gradient_checkpointing, kind=kind, **options)
        self.kind = kind

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
        self.max_state_dim, self.bins_padded = int(processing.max_state_dim), bool(processing.bins_padded)
        if self.state_dim > self.max_state_dim:
            raise ValueError(f"{OWNER}: the observation's state has {self.state_dim} elements "
                             f"({[e.key for e in self.state_reader.layout.entries]}), the model at most "
                             f"{self.max_state_dim}: "
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
        if self.kind == "pi0":  # the prompt does not change with the state: tokenised once per instruction
            ids, mask = self._tokenized(self.texts, None)
            self.register_buffer("prompt_ids", ids, persistent=False)
            self.register_buffer("prompt_mask", mask, persistent=False)

        # ---- the model: dtype, LoRA, checkpointing
        self.backbone = self._adopt_model(model, (model.embed_action_time, model.action_out_proj), lora_rank,
                                          lora_alpha, lora_targets)
        if gradient_checkpointing:
            self._enable_checkpointing()
            # the layers only write the prefix cache once and read it after: safe to recompute with it
            hf = self.hf_model
            for layer in (*hf.model.vlm.language_model.layers, *hf.model.dit.layers):
                layer._can_checkpoint_with_cache = True

        # ---- the noise head on the action expert; the value head on it (π0) or on the VLM (π0.5, RLinf's
        # value_after_vlm)
        width = int(cfg.dit_config.hidden_size)
        self._add_heads(width, width if kind == "pi0" else int(cfg.vlm_config.text_config.hidden_size),
                        kind == "pi0" if detach_value_input is None else detach_value_input)

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
        lerobot = is_lerobot_policy(path)
        # first: a wrong path is named before transformers is imported
        folder = LeRobotFolder.read(path) if lerobot else None
        path = folder.path if lerobot else check_pi0_dir(path)
        if feature_map is not None and not lerobot:
            raise ValueError(f"{OWNER}: feature_map renames a LeRobot policy folder's features; {str(path)!r} is in "
                             "transformers' layout: choose the entries with image_keys and state_keys")
        instruction = cls.instruction_option(instruction, instructions)
        low, high, execute = cls.action_bounds(action_space, execute)
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
                # the image processor's settings in a file of their own, where a checkpoint keeps them there
                processor_config["image_processor"] = json.loads((path / "preprocessor_config.json").read_text())
            processing = Processing.from_transformers(processor_config, model.config)
        return cls(model, tok, processing, obs_layout=layout, action_low=low, action_high=high,
                   execute=execute, instruction=instruction, instruction_classes=classes,
                   dtype=str(dtype).removeprefix("torch."), base_path=str(path.resolve()), **options)

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

    def _describe_camera(self, i: int) -> str:
        vision = self.hf_model.config.vlm_config.vision_config.image_size
        return (f"{type(self.hf_model).__name__} vision tower ({vision}x{vision} after the image processor, "
                f"{self.images.image_seq_length} tokens)")

    def _describe_state(self) -> str:
        return super()._describe_state() + (", in the prompt as 256 bins" if self.kind == "pi05" else "")

    # ---- the prompt -----------------------------------------------------------------------------

    def _tokenized(self, texts: list[str], bins: list[list[int]] | None) -> tuple[Tensor, Tensor]:
        """The processor's prompts for these instructions (and π0.5's state bins), tokenised."""
        bos = self.tokenizer.bos_token or ""
        prompts = [build_prompt(self.kind, self.image_prefix, bos, text, None if bins is None else bins[r])
                   for r, text in enumerate(texts)]
        return tokenize_prompts(self.tokenizer, prompts, self.max_length, self.pad_id)

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

    def _prefix(self, obs: Any, *, last_hidden: bool | None = None) -> Prefix:
        """The VLM's one pass over the prefix (as ``sample_actions`` runs it), its cache and last
        hidden states kept (``last_hidden`` changes nothing)."""
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

    def _features(self, prefix: Prefix) -> Tensor:
        """What the value head reads ``[B, width]``: π0's action expert at ``t = 1`` on the zero
        chunk, π0.5's VLM prefix averaged over its real tokens (RLinf's places)."""
        if self.kind == "pi0":
            x = torch.zeros(prefix.rows, self.chunk_size, self.max_action_dim, device=self._device)
            return self._expert(prefix, x, torch.ones(prefix.rows, device=self._device))[1].mean(1)
        return masked_mean(prefix.hidden, prefix.mask)

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


__all__ = ["PI0Policy"]
