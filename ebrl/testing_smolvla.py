"""Tiny random SmolVLA policy folders for tests and benchmarks (beside :mod:`ebrl.testing`'s
``save_random_pi0``): built from configs, nothing downloaded.
    >>> SMOLVLM2_500M["text_config"]["hidden_size"], SMOLVLM2_500M["scale_factor"]
    (960, 4)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

SMOLVLA_SENTENCES = ("pick up the red block", "open the drawer and reach the target", "reach the goal",
                     "put the cube in the box")
# SmolVLM2-500M-Video-Instruct's architecture (its config.json), which smolvla_base cuts to 16 layers
SMOLVLM2_500M = {
    "text_config": {"model_type": "llama", "hidden_size": 960, "intermediate_size": 2560, "num_hidden_layers": 32,
                    "num_attention_heads": 15, "num_key_value_heads": 5, "head_dim": 64, "rms_norm_eps": 1e-5,
                    "max_position_embeddings": 8192},
    "vision_config": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                      "num_attention_heads": 12, "image_size": 512, "patch_size": 16},
    "scale_factor": 4}
# the SmolVLM tokenizer's special tokens that SmolVLM's processor (and LeRobot's SmolVLA) look up
SMOLVLM_SPECIAL = {"fake_image_token": "<fake_token_around_image>", "image_token": "<image>",
                   "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>"}


def save_random_smolvm_dir(vlm_dir, *, image_size: int = 16, patch_size: int = 4, scale_factor: int = 2,
                           hidden: int = 32, heads: int = 4, kv_heads: int = 2, head_dim: int = 8, layers: int = 6,
                           sentences: Sequence[str] = SMOLVLA_SENTENCES, full_size: bool = False):
    """A local stand-in for a SmolVLM folder (``vlm=DIR``): ``config.json`` of a tiny
    ``SmolVLMConfig`` (or SmolVLM2-500M's architecture with ``full_size``), a word-level tokenizer
    trained on ``sentences`` with SmolVLM's special tokens and the newline as a token of its own,
    and SmolVLM's image processor settings. Returns the config."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, SmolVLMConfig
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    vlm_dir = Path(vlm_dir)
    vlm_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    special = ["<|endoftext|>", "<unk>", "<|im_start|>", *SMOLVLM_SPECIAL.values()]
    tok.train_from_iterator(list(sentences), trainers.WordLevelTrainer(special_tokens=special))
    tok.add_tokens([AddedToken("\n", normalized=False)])  # SmolVLA's prompts end with one
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<|endoftext|>",
                                        bos_token="<|im_start|>", eos_token="<end_of_utterance>",
                                        extra_special_tokens=SMOLVLM_SPECIAL)
    tokenizer.save_pretrained(str(vlm_dir))
    if full_size:
        text, vision = dict(SMOLVLM2_500M["text_config"]), dict(SMOLVLM2_500M["vision_config"])
        scale_factor, image_size = SMOLVLM2_500M["scale_factor"], vision["image_size"]
    else:
        text = {"model_type": "llama", "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
                "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim}
        vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                  "image_size": image_size, "patch_size": patch_size}
    text["vocab_size"] = len(tokenizer)
    config = SmolVLMConfig(text_config=text, vision_config=vision, scale_factor=scale_factor,
                           image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    config.save_pretrained(str(vlm_dir))
    SmolVLMImageProcessorPil(size={"longest_edge": image_size},
                             max_image_size={"longest_edge": image_size}).save_pretrained(str(vlm_dir))
    return config


def _all_stats(mean: Any, std: Any, n: int) -> dict[str, torch.Tensor]:
    """Every statistic LeRobot's datasets keep, from a mean and a std."""
    m = torch.as_tensor(np.broadcast_to(np.asarray(mean, np.float32), (n,)).copy())
    s = torch.as_tensor(np.broadcast_to(np.asarray(std, np.float32), (n,)).copy())
    return {"mean": m, "std": s, "min": m - 2 * s, "max": m + 2 * s, "q01": m - 2 * s, "q99": m + 2 * s,
            "q10": m - 1.28 * s, "q90": m + 1.28 * s}


def save_random_smolvla(path, vlm_dir, *, state_dim: int = 4, action_dim: int = 3, chunk_size: int = 4,
                        max_dim: int = 8, num_steps: int = 3, camera_names: Sequence[str] = ("camera1", "camera2"),
                        image_size: int = 16, camera_shape: Sequence[int] | None = None, empty_cameras: int = 0,
                        num_vlm_layers: int = 4, vlm_layers: int = 6, self_attn_every_n_layers: int = 2,
                        norm_modes: Mapping[str, str] | None = None, state_mean: Any = 0.0, state_std: Any = 1.0,
                        action_mean: Any = 0.0, action_std: Any = 0.5, pad_language_to: str = "longest",
                        tokenizer_max_length: int = 12, seed: int = 0, full_size: bool = False,
                        dtype: torch.dtype | None = None):
    """Write a tiny random SmolVLA as a LeRobot policy folder at ``path`` and its VLM stand-in at
    ``vlm_dir`` (:func:`save_random_smolvm_dir`): a SmolVLM of ``vlm_layers`` text layers cut to
    ``num_vlm_layers``, the expert 0.75 times as wide, features ``observation.images.<name>`` for
    ``camera_names`` (``camera_shape``, default ``[3, image_size, image_size]``), ``observation.state``
    (``state_dim``) and ``action`` (``action_dim``), chunks of ``chunk_size`` padded to
    ``max_dim``; ``norm_modes`` (``{"STATE": ..., "ACTION": ...}``) over SmolVLA's defaults, with every
    statistic LeRobot's datasets keep (min/max and q01/q99 = mean -/+ 2 std, q10/q90 = mean -/+ 1.28
    std). ``full_size``: SmolVLM2-500M's architecture cut to 16 layers and LeRobot's SmolVLA
    defaults (chunks of 50 actions of 32 dims, 512-pixel cameras, 10 steps) instead, in ``dtype``.
    Returns the model."""
    from ebrl.policies.lerobot_layout import flat_stats
    from ebrl.policies.pi0.lerobot import ACTION, OBS_IMAGES, OBS_STATE
    from ebrl.policies.smolvla.lerobot import (
        LEROBOT_CONFIG_DEFAULTS,
        lerobot_smolvla_config,
        lerobot_state_dict,
        smolvla_pipelines,
        write_smolvla_folder,
    )
    from ebrl.policies.smolvla.model import SmolVLAModel, SmolVLASettings

    vlm_config = save_random_smolvm_dir(vlm_dir, image_size=image_size, layers=vlm_layers, full_size=full_size)
    if full_size:
        settings = SmolVLASettings()
        image_size = vlm_config.vision_config.image_size
        fields: dict[str, Any] = {}
    else:
        settings = SmolVLASettings(chunk_size=chunk_size, max_state_dim=max_dim, max_action_dim=max_dim,
                                   num_steps=num_steps, num_vlm_layers=num_vlm_layers,
                                   self_attn_every_n_layers=self_attn_every_n_layers)
        fields = {"n_action_steps": chunk_size, "resize_imgs_with_padding": [image_size, image_size],
                  "tokenizer_max_length": tokenizer_max_length}
    shape = list(camera_shape or (3, image_size, image_size))
    inputs = {f"{OBS_IMAGES}.{name}": {"type": "VISUAL", "shape": shape} for name in camera_names}
    inputs[OBS_STATE] = {"type": "STATE", "shape": [state_dim]}
    outputs = {ACTION: {"type": "ACTION", "shape": [action_dim]}}
    modes = {**LEROBOT_CONFIG_DEFAULTS["normalization_mapping"], **(norm_modes or {})}
    config = lerobot_smolvla_config(settings, inputs, outputs, normalization_mapping=modes,
                                    empty_cameras=empty_cameras, pad_language_to=pad_language_to, **fields)
    stats = {OBS_STATE: _all_stats(state_mean, state_std, state_dim),
             ACTION: _all_stats(action_mean, action_std, action_dim)}
    for name in camera_names:  # datasets keep image statistics too, per channel; IDENTITY leaves them unread
        stats[f"{OBS_IMAGES}.{name}"] = {k: v[:1].expand(3).reshape(3, 1, 1).clone()
                                         for k, v in _all_stats(0.5, 0.25, 1).items()}
    default_dtype = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if dtype is not None:
            torch.set_default_dtype(dtype)
        try:
            model = SmolVLAModel(vlm_config, settings).eval()
        finally:
            torch.set_default_dtype(default_dtype)
    write_smolvla_folder(path, config, lerobot_state_dict(model), smolvla_pipelines(config, flat_stats(stats)))
    return model


__all__ = ["SMOLVLA_SENTENCES", "SMOLVLM2_500M", "save_random_smolvla", "save_random_smolvm_dir"]
