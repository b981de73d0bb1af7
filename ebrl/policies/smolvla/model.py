"""SmolVLA's network: a truncated SmolVLM and an action expert reading its keys and values.

The modules and their attribute names follow LeRobot's ``VLAFlowMatching`` /
``SmolVLMWithExpertModel``, so ``SmolVLAModel.state_dict()`` is LeRobot's ``model.safetensors``
less the leading ``model.``: ``vlm_with_expert.vlm`` (transformers' SmolVLM, its text model cut
to ``num_vlm_layers`` layers), ``vlm_with_expert.lm_expert`` (a Llama decoder stack of the same
depth, ``expert_width_multiplier`` times narrower, no token embedding; in ``cross_attn`` mode every
layer but each ``self_attn_every_n_layers``-th projects the VLM's keys and values with its own
``k_proj`` / ``v_proj``), ``state_proj``, ``action_in_proj``, ``action_out_proj`` and
``action_time_mlp_in`` / ``_out``.

Only the layers' weights are transformers'; the passes are SmolVLA's own
(:mod:`~ebrl.policies.smolvla.attention`). Sampling is split for the flow chains: :meth:`prefix_kv`
runs the VLM once over images, prompt and state and keeps each layer's keys and values;
:meth:`velocity` is one expert pass, a pure function of that cache, ``x_t`` and ``t``. Flow
matching as LeRobot's: ``x_t = t noise + (1 - t) actions``, velocity ``noise - actions``, sampled
from ``t = 1`` to 0 in ``num_steps`` Euler steps.

    >>> expert_intermediate_size(int(960 * 0.75))  # smolvla_base's expert: 720 wide
    2048
    >>> SmolVLASettings.from_lerobot({"type": "smolvla", "chunk_size": 10, "num_steps": None}).chunk_size
    10
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ebrl.policies.smolvla.attention import attention, make_att_2d_masks, rope, sinusoidal_time_embedding


@dataclasses.dataclass(frozen=True)
class SmolVLASettings:
    """The fields of LeRobot's ``SmolVLAConfig`` that shape the network and its sampling
    (defaults: LeRobot's)."""

    chunk_size: int = 50
    max_state_dim: int = 32
    max_action_dim: int = 32
    num_steps: int = 10
    num_vlm_layers: int = 16
    num_expert_layers: int = -1
    self_attn_every_n_layers: int = 2
    expert_width_multiplier: float = 0.75
    attention_mode: str = "cross_attn"
    min_period: float = 4e-3
    max_period: float = 4.0
    prefix_length: int = -1
    add_image_special_tokens: bool = False

    @classmethod
    def from_lerobot(cls, config: Mapping[str, Any]) -> SmolVLASettings:
        """From a LeRobot ``config.json`` (fields it lacks keep LeRobot's defaults)."""
        return cls(**{f.name: config[f.name] for f in dataclasses.fields(cls) if config.get(f.name) is not None})


def expert_intermediate_size(hidden: int, ffn_dim_multiplier: int = 4, multiple_of: int = 256) -> int:
    """The expert's MLP width (LeRobot's ``get_intermediate_size``): ``4 * int(2 h / 3)`` rounded
    up to a multiple of 256."""
    hidden = int(2 * hidden / 3)
    hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def expert_config(text_config, settings: SmolVLASettings, num_vlm_layers: int):
    """The action expert's Llama config: the VLM text config with ``hidden_size`` scaled by
    ``expert_width_multiplier`` (heads and head dim kept, so both stacks share one attention
    layout), its MLP width by :func:`expert_intermediate_size`, ``num_vlm_layers`` layers."""
    config = copy.deepcopy(text_config)
    width = int(text_config.hidden_size * settings.expert_width_multiplier)
    config.hidden_size = width
    config.intermediate_size = expert_intermediate_size(width)
    config.num_hidden_layers = num_vlm_layers
    if settings.num_expert_layers > 0:
        config.num_hidden_layers = settings.num_expert_layers
    return config


def lerobot_patch_positions(embeddings: nn.Module, pixel_values: Tensor, patch_attention_mask: Tensor) -> Tensor:
    """SmolVLM's vision embeddings with the patch positions LeRobot's SmolVLA checkpoints were trained
    with (transformers 4.x): each side's fractions ``i / n`` are scaled by ``1 - 1e-6`` before
    bucketing, so every patch but the first lands one bucket low (positions 0, 0, 1, ..., n - 2 along
    a side). transformers 5 buckets ``i / n`` unscaled (0, 1, ..., n - 1); on LeRobot's weights that
    moved sampled actions by up to 0.012 (tests/test_smolvla_golden.py, golden outputs from LeRobot
    0.4.4 with transformers 4.57)."""
    batch, _, height, width = pixel_values.shape
    out = embeddings.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
    side, device = embeddings.num_patches_per_side, pixel_values.device
    boundaries = torch.arange(1 / side, 1.0, 1 / side, device=device)
    ids = torch.zeros(batch, (height // embeddings.patch_size) * (width // embeddings.patch_size), dtype=torch.long,
                      device=device)
    for b, mask in enumerate(patch_attention_mask):
        nh, nw = mask[:, 0].sum(), mask[0].sum()
        fh = torch.arange(nh, device=device, dtype=pixel_values.dtype) / nh * (1 - 1e-6)
        fw = torch.arange(nw, device=device, dtype=pixel_values.dtype) / nw * (1 - 1e-6)
        bh, bw = torch.bucketize(fh, boundaries, right=True), torch.bucketize(fw, boundaries, right=True)
        ids[b][mask.view(-1)] = (bh[:, None] * side + bw).flatten()
    return out + embeddings.position_embedding(ids)


class VLMWithExpert(nn.Module):
    """LeRobot's ``SmolVLMWithExpertModel``'s modules: ``vlm`` and ``lm_expert``."""

    def __init__(self, vlm_config, settings: SmolVLASettings):
        super().__init__()
        from transformers import AutoModel, SmolVLMForConditionalGeneration

        vlm_config = copy.deepcopy(vlm_config)
        depth = vlm_config.text_config.num_hidden_layers
        if settings.num_vlm_layers > 0:
            depth = min(depth, settings.num_vlm_layers)
        # built at the truncated depth: the same parameters as LeRobot's slice of the full stack
        vlm_config.text_config.num_hidden_layers = depth
        self.vlm = SmolVLMForConditionalGeneration(vlm_config)
        vision = self.vlm.model.vision_model.embeddings
        vision.forward = functools.partial(lerobot_patch_positions, vision)
        if settings.num_expert_layers > 0 and settings.num_expert_layers != depth:
            # LeRobot skips the expert at some layers then; its cached sampling fails on such a model
            raise NotImplementedError(f"num_expert_layers={settings.num_expert_layers} other than the VLM's {depth} "
                                      "layers is not supported")
        text = vlm_config.text_config
        config = expert_config(text, settings, depth)
        self.lm_expert = AutoModel.from_config(config)
        self.cross_layers = tuple(i for i in range(depth) if "cross" in settings.attention_mode and not (
            settings.self_attn_every_n_layers > 0 and i % settings.self_attn_every_n_layers == 0))
        kv_in = text.num_key_value_heads * text.head_dim
        kv_out = config.num_key_value_heads * config.head_dim
        for i in self.cross_layers:  # these read the VLM's keys and values, not the expert's hidden states
            attn = self.lm_expert.layers[i].self_attn
            attn.k_proj = nn.Linear(kv_in, kv_out, bias=config.attention_bias)
            attn.v_proj = nn.Linear(kv_in, kv_out, bias=config.attention_bias)
        self.lm_expert.embed_tokens = None
        self.expert_hidden_size = int(config.hidden_size)
        self.head_dim = int(text.head_dim)

    @property
    def text_model(self):
        return self.vlm.model.text_model


@dataclasses.dataclass(frozen=True)
class PrefixKV:
    """The VLM's pass over one prefix (images, prompt, state), batch first: each layer's keys
    (rotated) and values ``[B, layers, L, Hkv, D]`` and which of the ``L`` tokens are real."""

    keys: Tensor
    values: Tensor
    pad_masks: Tensor
    hidden: Tensor | None = None  # [B, L, width] the VLM's last hidden states (normed), where asked for

    @property
    def rows(self) -> int:
        return self.pad_masks.shape[0]

    def repeat_interleave(self, n: int) -> PrefixKV:
        """Each sample's prefix ``n`` times in a row (``n`` samples of one observation)."""
        return PrefixKV(*(None if t is None else t.repeat_interleave(n, dim=0)
                          for t in (self.keys, self.values, self.pad_masks, self.hidden)))


def _pad_sequence(x: Tensor, length: int) -> Tensor:
    """``x`` ``[B, L, ...]`` with zeros (False) after its ``L`` entries up to ``length``."""
    out = x.new_zeros((x.shape[0], length, *x.shape[2:]))
    out[:, : x.shape[1]] = x
    return out


def _project_qkv(layer, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    attn = layer.self_attn
    normed = layer.input_layernorm(hidden).to(attn.q_proj.weight.dtype)
    shape = (*normed.shape[:-1], -1, attn.head_dim)
    return attn.q_proj(normed).view(shape), attn.k_proj(normed).view(shape), attn.v_proj(normed).view(shape)


def _finish_layer(layer, hidden: Tensor, attended: Tensor) -> Tensor:
    """The output projection and the MLP, each with its residual."""
    out = layer.self_attn.o_proj(attended.to(layer.self_attn.o_proj.weight.dtype)) + hidden
    return layer.mlp(layer.post_attention_layernorm(out)) + out


def _checkpointed(on: bool, fn, *args):
    """``fn(*args)``, its activations recomputed in the backward pass where ``on`` and gradients are on."""
    if on and torch.is_grad_enabled():
        from torch.utils.checkpoint import checkpoint

        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


class SmolVLAModel(nn.Module):
    """LeRobot's ``VLAFlowMatching``: ``vlm_config`` a transformers ``SmolVLMConfig`` (the
    checkpoint's VLM, e.g. SmolVLM2-500M-Video-Instruct's), ``settings`` SmolVLA's own fields."""

    def __init__(self, vlm_config, settings: SmolVLASettings = SmolVLASettings()):
        super().__init__()
        if settings.add_image_special_tokens:
            raise NotImplementedError("add_image_special_tokens=True (image start/end tokens around each camera) "
                                      "is not supported")
        self.settings = settings
        self.vlm_with_expert = VLMWithExpert(vlm_config, settings)
        width = self.vlm_with_expert.expert_hidden_size
        self.state_proj = nn.Linear(settings.max_state_dim, vlm_config.text_config.hidden_size)
        self.action_in_proj = nn.Linear(settings.max_action_dim, width)
        self.action_out_proj = nn.Linear(width, settings.max_action_dim)
        self.action_time_mlp_in = nn.Linear(2 * width, width)
        self.action_time_mlp_out = nn.Linear(width, width)
        self.gradient_checkpointing = False  # True: each layer's activations recomputed in the backward pass

    # ---- the prefix: images, prompt, state -----------------------------------------------------

    def embed_image(self, image: Tensor) -> Tensor:
        """``[B, tokens, hidden]``: the vision tower and connector (pixel shuffle, projection) on
        ``[B, 3, H, W]`` pixels in ``[-1, 1]``."""
        model = self.vlm_with_expert.vlm.model
        pixels = image.to(model.vision_model.dtype)
        return model.connector(model.vision_model(pixel_values=pixels).last_hidden_state)

    def embed_prefix(self, images: Sequence[Tensor], img_masks: Sequence[Tensor], lang_tokens: Tensor,
                     lang_masks: Tensor, state: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(embeddings [B, L, hidden], pad_masks [B, L], att_masks [B, L])``: each camera's tokens
        (scaled by ``sqrt(hidden)``, masked out where its ``img_masks`` entry is False), the prompt's
        embeddings (scaled likewise), then one state token. Images and prompt form one block
        (``att_masks`` 0); the state opens the next (1), which they cannot see."""
        embs, pad_masks, att_masks = [], [], []
        for image, mask in zip(images, img_masks, strict=True):
            emb = self.embed_image(image)
            emb = emb * torch.tensor(emb.shape[-1] ** 0.5, dtype=emb.dtype, device=emb.device)
            embs.append(emb)
            pad_masks.append(mask[:, None].expand(emb.shape[0], emb.shape[1]))
            att_masks += [0] * emb.shape[1]
        lang = self.vlm_with_expert.text_model.get_input_embeddings()(lang_tokens)
        embs.append(lang * math.sqrt(lang.shape[-1]))
        pad_masks.append(lang_masks)
        att_masks += [0] * lang.shape[1]
        # in the prompt's dtype: a float32 state_proj beside a bf16 VLM (a no-op in one dtype)
        state_emb = self.state_proj(state.to(self.state_proj.weight.dtype)).to(lang.dtype)
        state_emb = state_emb[:, None, :] if state_emb.ndim == 2 else state_emb
        batch = state_emb.shape[0]
        embs.append(state_emb)
        pad_masks.append(torch.ones(batch, state_emb.shape[1], dtype=torch.bool, device=state_emb.device))
        att_masks += [1] * state_emb.shape[1]
        embs = torch.cat(embs, dim=1)
        pad_masks = torch.cat(pad_masks, dim=1)
        att = torch.tensor(att_masks, dtype=torch.bool, device=pad_masks.device)[None, :]
        length = self.settings.prefix_length
        if pad_masks.shape[1] < length:  # a fixed prefix length: zeros, masked out
            embs, pad_masks, att = (_pad_sequence(t, length) for t in (embs, pad_masks, att))
        return embs, pad_masks, att.expand(batch, -1)

    def prefix_kv(self, images: Sequence[Tensor], img_masks: Sequence[Tensor], lang_tokens: Tensor,
                  lang_masks: Tensor, state: Tensor, *, last_hidden: bool = False) -> PrefixKV:
        """The VLM's pass over the prefix, once per observation: every layer's keys and values
        (and, with ``last_hidden``, the last layer's output after the final norm, which sampling
        does not need)."""
        embs, pad_masks, att_masks = self.embed_prefix(images, img_masks, lang_tokens, lang_masks, state)
        mask = make_att_2d_masks(pad_masks, att_masks)
        positions = torch.cumsum(pad_masks, dim=1) - 1
        text_model = self.vlm_with_expert.text_model
        layers = text_model.layers
        head_dim = self.vlm_with_expert.head_dim

        def step(layer, hidden: Tensor, finish: bool) -> tuple[Tensor, Tensor, Tensor]:
            query, key, value = _project_qkv(layer, hidden)
            query, key = rope(query, positions), rope(key, positions)
            if finish:
                hidden = _finish_layer(layer, hidden, attention(query, key, value, mask, head_dim))
            return key, value, hidden

        hidden, keys, values = embs, [], []
        for i, layer in enumerate(layers):
            # the last layer's output feeds nothing but the last hidden states
            key, value, hidden = _checkpointed(self.gradient_checkpointing, step, layer, hidden,
                                               last_hidden or i + 1 < len(layers))
            keys.append(key)
            values.append(value)
        out = text_model.norm(hidden) if last_hidden else None
        return PrefixKV(torch.stack(keys, dim=1), torch.stack(values, dim=1), pad_masks, out)

    # ---- the suffix: noisy actions and time ----------------------------------------------------

    def embed_suffix(self, x_t: Tensor, time: Tensor) -> Tensor:
        """``[B, chunk, expert width]``: each noisy action's embedding beside the time's
        sinusoidal embedding, mixed by a two-layer SiLU MLP."""
        action = self.action_in_proj(x_t.to(self.action_in_proj.weight.dtype))
        width = self.vlm_with_expert.expert_hidden_size
        time_emb = sinusoidal_time_embedding(time, width, self.settings.min_period, self.settings.max_period)
        time_emb = time_emb.to(action.dtype)[:, None, :].expand_as(action)
        mixed = self.action_time_mlp_in(torch.cat([action, time_emb], dim=2))
        return self.action_time_mlp_out(F.silu(mixed))

    def expert_hidden(self, prefix: PrefixKV, x_t: Tensor, t: Tensor) -> Tensor:
        """The expert's last hidden states over the chunk ``[B, chunk, expert width]`` (after its
        final norm) at ``x_t`` ``[B, chunk, max_action_dim]``, time ``t`` ``[B]``: one expert pass
        over the cached prefix. Action tokens see every real prefix token and the action tokens
        before them (causal); self-attention layers put them after the prefix's positions,
        cross-attention layers count from 0."""
        expert = self.vlm_with_expert.lm_expert
        # in the expert's dtype: float32 action/time projections beside a bf16 expert (a no-op in one dtype)
        hidden = self.embed_suffix(x_t, t).to(expert.norm.weight.dtype)
        batch, length = hidden.shape[:2]
        device = hidden.device
        prefix_len = prefix.pad_masks.shape[1]
        sees_prefix = prefix.pad_masks[:, None, :].expand(batch, length, prefix_len)
        ones = torch.ones(batch, length, dtype=torch.bool, device=device)
        self_mask = torch.cat([sees_prefix, make_att_2d_masks(ones, ones.float())], dim=2)
        steps = torch.arange(length, device=device)[None, :].expand(batch, length)
        positions = prefix.pad_masks.sum(dim=-1)[:, None] + steps
        head_dim = self.vlm_with_expert.head_dim
        cross = self.vlm_with_expert.cross_layers

        def step(i: int, layer, hidden: Tensor, keys: Tensor, values: Tensor) -> Tensor:
            attn = layer.self_attn
            if i in cross:
                normed = layer.input_layernorm(hidden).to(attn.q_proj.weight.dtype)
                query = rope(attn.q_proj(normed).view(batch, length, -1, attn.head_dim), steps)
                vlm_keys = keys.flatten(2).to(attn.k_proj.weight.dtype)
                vlm_values = values.flatten(2).to(attn.v_proj.weight.dtype)
                key = attn.k_proj(vlm_keys).view(batch, prefix_len, -1, attn.head_dim)
                value = attn.v_proj(vlm_values).view(batch, prefix_len, -1, attn.head_dim)
                attended = attention(query, key, value, sees_prefix, head_dim)
            else:
                query, key, value = _project_qkv(layer, hidden)
                query, key = rope(query, positions), rope(key, positions)
                key = torch.cat([keys, key], dim=1)
                value = torch.cat([values, value], dim=1)
                attended = attention(query, key, value, self_mask, head_dim)
            return _finish_layer(layer, hidden, attended)

        for i, layer in enumerate(expert.layers):
            hidden = _checkpointed(self.gradient_checkpointing, step, i, layer, hidden, prefix.keys[:, i],
                                   prefix.values[:, i])
        return expert.norm(hidden)[:, -self.settings.chunk_size:]

    def velocity(self, prefix: PrefixKV, x_t: Tensor, t: Tensor) -> Tensor:
        """The flow's velocity ``[B, chunk, max_action_dim]`` (float32) at ``x_t`` (same shape),
        time ``t`` ``[B]``: :meth:`expert_hidden` through ``action_out_proj``."""
        return self.action_out_proj(self.expert_hidden(prefix, x_t, t).to(torch.float32))

    # ---- sampling and the SFT loss -------------------------------------------------------------

    def sample_actions(self, images: Sequence[Tensor], img_masks: Sequence[Tensor], lang_tokens: Tensor,
                       lang_masks: Tensor, state: Tensor, noise: Tensor | None = None,
                       num_steps: int | None = None) -> Tensor:
        """LeRobot's reference ODE: Euler from ``t = 1`` (``noise``, ``[B, chunk, max_action_dim]``,
        standard normal where None) to 0 in ``num_steps`` (the settings' by default) steps."""
        batch = state.shape[0]
        if noise is None:
            noise = torch.randn(batch, self.settings.chunk_size, self.settings.max_action_dim, device=state.device)
        prefix = self.prefix_kv(images, img_masks, lang_tokens, lang_masks, state)
        steps = int(num_steps or self.settings.num_steps)
        dt = -1.0 / steps
        x_t = noise
        for step in range(steps):
            t = torch.tensor(1.0 + step * dt, dtype=torch.float32, device=state.device).expand(batch)
            x_t = x_t + dt * self.velocity(prefix, x_t, t)
        return x_t

    def flow_loss(self, images: Sequence[Tensor], img_masks: Sequence[Tensor], lang_tokens: Tensor,
                  lang_masks: Tensor, state: Tensor, actions: Tensor, noise: Tensor, time: Tensor) -> Tensor:
        """LeRobot's SFT loss, per element ``[B, chunk, max_action_dim]`` (LeRobot averages all of
        it, padded action dims included): the squared error of the velocity at
        ``x_t = t noise + (1 - t) actions`` against ``noise - actions``. ``actions`` padded to
        ``max_action_dim``, ``time`` ``[B]``. LeRobot runs prefix and suffix in one pass; the
        prefix never sees the suffix, so the cached pass is the same computation."""
        t = time[:, None, None]
        x_t = t * noise + (1 - t) * actions
        target = noise - actions
        v_t = self.velocity(self.prefix_kv(images, img_masks, lang_tokens, lang_masks, state), x_t, time)
        return F.mse_loss(target, v_t, reduction="none")


__all__ = ["PrefixKV", "SmolVLAModel", "SmolVLASettings", "VLMWithExpert", "expert_config",
           "expert_intermediate_size"]
