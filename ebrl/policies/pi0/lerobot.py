"""LeRobot's π0 / π0.5 policy folders: loaded as :class:`~ebrl.policies.pi0.policy.PI0Policy`, and
trained policies written back for LeRobot (``lerobot-record``, ``lerobot-eval``) on the robot.

A folder that LeRobot's ``PI0Policy.save_pretrained`` / ``PI05Policy.save_pretrained`` writes holds:

- ``config.json``: LeRobot's policy config (``"type": "pi0"`` or ``"pi05"``, no ``model_type``):
  ``input_features`` / ``output_features``, ``chunk_size``, ``max_state_dim``, ``max_action_dim``,
  ``num_inference_steps``, ``image_resolution``, ``empty_cameras``, ``tokenizer_max_length``,
  ``normalization_mapping`` and the Gemma variants;
- ``model.safetensors`` in LeRobot's parameter names (``model.paligemma_with_expert...``);
- ``policy_preprocessor.json`` / ``policy_postprocessor.json``: the processor pipelines, whose
  normaliser / unnormaliser steps keep the dataset statistics in
  ``policy_preprocessor_step_<i>_normalizer_processor.safetensors`` (and the postprocessor's twin).

**In.** transformers' ``PI0ForConditionalGeneration`` / ``PI05ForConditionalGeneration`` load the
weights through transformers' own conversion mapping (entry ``pi0``): nothing is renamed here. The
model's configuration comes from ``config.json`` and the layer sizes from the weights' shapes (the
safetensors header, no tensor read): every Gemma variant LeRobot defines has one key/value head,
and LeRobot's vision tower is PaliGemma's SigLIP with 16 heads. Where ``config.json`` names a
variant (``gemma_2b``, ``gemma_300m``) the weights must agree with it. The state and actions are
normalised with the pipelines' statistics in the pipelines' modes
(:class:`~ebrl.policies.normalization.FeatureNorm`); cameras are prepared as LeRobot's π0 does
(:class:`LeRobotImages`); π0.5's prompt bins the state padded to
``max_state_dim``. A camera feature the env does not have is left out, as LeRobot fills it (an
empty, masked image: the model attends to none of its tokens), and ``empty_cameras`` likewise.
The folder holds no tokenizer: ``tokenizer=DIR`` names a local copy of the one its preprocessor
names (PaliGemma's).

**Out.** :func:`save_lerobot` writes a trained :class:`~ebrl.policies.pi0.policy.PI0Policy` as such a
folder: the weights with LoRA merged, in LeRobot's names (the inverse of transformers' mapping,
checked by loading them back through it), ``config.json`` and both pipelines with their statistics,
plus the tokenizer (LeRobot ignores it; EBRL reloads the folder without ``tokenizer=``). The noise
head and the value head are RL's alone and are not written: LeRobot's π0 samples with the ODE.
:func:`save_transformers` writes transformers' own layout (model, tokenizer and
``PI0Processor`` / ``PI05Processor`` with the statistics; mean/std or quantile statistics only,
which is all those processors read).

    >>> is_lerobot_policy("/models/not-there")
    False
    >>> LeRobotFolder.read("/models/not-there")
    Traceback (most recent call last):
    ...
    FileNotFoundError: LeRobot policy folder '/models/not-there' does not exist (EBRL loads local ...
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ebrl.policies.hf_backbone import INSTRUCTION_KEY, NEVER_DOWNLOADS, TOKENIZER_FILES
from ebrl.policies.lerobot_layout import CONFIG, POSTPROCESSOR, PREPROCESSOR, WEIGHTS, PolicyFolder, weight_shapes
from ebrl.policies.normalization import EPS, FeatureNorm, NormalizationMode

TYPES = ("pi0", "pi05")
OBS_IMAGES, OBS_STATE, ACTION = "observation.images", "observation.state", "action"
VLM = "model.paligemma_with_expert.paligemma."
EXPERT = "model.paligemma_with_expert.gemma_expert."
PALIGEMMA_TOKENIZER = "google/paligemma-3b-pt-224"  # what LeRobot's tokenizer step names
# LeRobot's get_gemma_config (openpi's gemma.py)
VARIANTS = {"gemma_300m": {"width": 1024, "depth": 18, "mlp_dim": 4096, "num_heads": 8, "num_kv_heads": 1,
                           "head_dim": 256},
            "gemma_2b": {"width": 2048, "depth": 18, "mlp_dim": 16384, "num_heads": 8, "num_kv_heads": 1,
                         "head_dim": 256}}
VISION_HEADS = 16  # PaliGemma's SigLIP So400m, which LeRobot's π0 always builds
DEFAULT_NORMALIZATION = {"pi0": {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"},
                         "pi05": {"VISUAL": "IDENTITY", "STATE": "QUANTILES", "ACTION": "QUANTILES"}}


@dataclasses.dataclass(frozen=True)
class LeRobotImages:
    """What LeRobot's π0 / π0.5 do to a camera frame (``PI0Policy._preprocess_images``): ``uint8``
    to ``[0, 1]``, and where the frame is not ``resolution`` already, openpi's
    ``resize_with_pad_torch`` (bilinear without antialiasing, the aspect kept, centred, padded
    with -1), then ``x * 2 - 1``."""

    resolution: tuple[int, int]
    image_seq_length: int

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        return tuple(int(v) for v in self.resolution)

    def preprocess(self, frames: Tensor) -> Tensor:
        if frames.shape[1] == 1:
            frames = frames.expand(-1, 3, -1, -1)
        x = frames.float() / 255.0
        height, width = self.output_size(*x.shape[-2:])
        h, w = x.shape[-2:]
        if (h, w) != (height, width):
            ratio = max(w / width, h / height)
            new_h, new_w = int(h / ratio), int(w / ratio)
            x = F.interpolate(x, size=(new_h, new_w), mode="bilinear", align_corners=False).clamp(-1.0, 1.0)
            top, left = (height - new_h) // 2, (width - new_w) // 2
            x = F.pad(x, (left, width - new_w - left, top, height - new_h - top), value=-1.0)
        return x * 2.0 - 1.0



def is_lerobot_config(config: Any) -> bool:
    """Whether a parsed ``config.json`` is a LeRobot π0 / π0.5 policy config (``type``, no ``model_type``)."""
    return isinstance(config, dict) and "model_type" not in config and config.get("type") in TYPES


def _lerobot_config_of(path: str | Path | None) -> dict[str, Any] | None:
    """``path/config.json`` where it is a LeRobot π0 / π0.5 policy config, else None."""
    if not path:
        return None
    try:
        config = json.loads((Path(path).expanduser() / CONFIG).read_text())
    except (OSError, ValueError):
        return None
    return config if is_lerobot_config(config) else None


def is_lerobot_policy(path: str | Path) -> bool:
    """Whether ``path/config.json`` is a LeRobot π0 / π0.5 policy config."""
    return _lerobot_config_of(path) is not None


class LeRobotFolder(PolicyFolder):
    """A LeRobot π0 / π0.5 policy folder, read (its JSON and the weights' header; no tensor)."""

    TYPES = TYPES

    @property
    def kind(self) -> str:
        return str(self.config["type"])

    # ---- features -------------------------------------------------------------------------------

    def features(self) -> dict[str, dict[str, Any]]:
        """``input_features`` then ``output_features``: ``{name: {"type", "shape"}}``."""
        return {**(self.config.get("input_features") or {}), **(self.config.get("output_features") or {})}

    def cameras(self) -> list[str]:
        """The camera features, in the order the model reads them (empty cameras left out)."""
        return [k for k, f in self.features().items() if f.get("type") == "VISUAL"
                and not k.startswith(f"{OBS_IMAGES}.empty_camera_")]

    def env_keys(self, observation_space, action_dim: int, *, feature_map: Mapping[str, str] | None = None,
                 image_keys: Sequence[str] | None = None,
                 state_keys: Sequence[str] | None = None) -> tuple[list[str], list[str]]:
        """``(image_keys, state_keys)``: the env entries the checkpoint's cameras and state read,
        by name (``observation.images.front`` reads ``front``; ``observation.state`` reads
        ``state``, or the one Box entry there is) and shape, or as ``feature_map`` says. A
        mismatch is one :class:`ValueError` listing both sides."""
        from gymnasium import spaces

        from ebrl.policies.encoders import ObsLayout

        if image_keys is not None or state_keys is not None:
            raise ValueError(f"{self.path}: a LeRobot policy folder's features name the env entries it reads; "
                             "say which with feature_map={feature: env key}, not image_keys/state_keys")
        features = self.features()
        fmap = dict(feature_map or {})
        unknown = sorted(set(fmap) - set(features))
        if unknown:
            raise ValueError(f"feature_map names {unknown}, which are not features of {self.path} "
                             f"(it has {sorted(features)})")
        if not isinstance(observation_space, spaces.Dict):
            raise ValueError(f"{self.path} reads a Dict observation (cameras and state by name), got "
                             f"{observation_space}")
        exclude = (INSTRUCTION_KEY,) if INSTRUCTION_KEY in observation_space.spaces else ()
        env = ObsLayout.from_space(observation_space, exclude=exclude)
        env_images = [e.key for e in env.images]
        env_vectors = {e.key: e.size for e in env.vectors}

        def sides() -> str:
            ours = {k: list(f.get("shape", [])) for k, f in features.items()}
            theirs = {e.key: list(e.shape) for e in (*env.images, *env.vectors)}
            return f"the checkpoint's features {ours}; the env's entries {theirs} (map them with feature_map=)"

        cameras = []
        for feature in self.cameras():
            name = fmap.get(feature, feature if feature in env_images else feature.removeprefix(f"{OBS_IMAGES}."))
            if name in env_images:
                cameras.append(name)
            elif feature in fmap:
                raise ValueError(f"feature_map maps {feature} to {name!r}, which is not a camera of the env: "
                                 + sides())
        unread = [k for k in env_images if k not in cameras]
        if unread or (self.cameras() and not cameras):
            raise ValueError(f"{self.path}: " + (f"the env's cameras {unread} are no feature of the checkpoint"
                                                 if unread else "no camera of the checkpoint is in the env")
                             + "; " + sides())
        state = []
        if OBS_STATE in features:
            want = int(features[OBS_STATE]["shape"][0])
            name = fmap.get(OBS_STATE)
            if name is None:
                name = next((k for k in (OBS_STATE, "state") if k in env_vectors), None)
                if name is None and len(env_vectors) == 1:
                    name = next(iter(env_vectors))
            if name not in env_vectors or env_vectors[name] != want:
                raise ValueError(f"{self.path}: {OBS_STATE} (shape [{want}]) reads "
                                 + (f"{name!r} of {env_vectors.get(name)} elements" if name in env_vectors
                                    else "no Box entry of the env") + "; " + sides())
            state = [name]
        action = features.get(ACTION)
        if action is not None and int(action["shape"][0]) != int(action_dim):
            raise ValueError(f"{self.path}: the checkpoint's action has shape {list(action['shape'])}, the env's "
                             f"actions {action_dim} dims")
        return cameras, state

    # ---- the model ------------------------------------------------------------------------------

    def _shape(self, name: str) -> tuple[int, ...]:
        try:
            return self.shapes[name]
        except KeyError:
            raise ValueError(f"{self.path / WEIGHTS} has no {name}: not the weights of a LeRobot "
                             f"{self.kind}") from None

    def _layers(self, prefix: str) -> int:
        pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
        found = {int(m.group(1)) for k in self.shapes if (m := pattern.match(k))}
        if not found:
            raise ValueError(f"{self.path / WEIGHTS} has no {prefix}N. layers: not the weights of a LeRobot "
                             f"{self.kind}")
        return max(found) + 1

    def _gemma(self, prefix: str) -> dict[str, int]:
        """A Gemma's sizes from its weights (one key/value head, as every variant LeRobot defines)."""
        q = self._shape(f"{prefix}layers.0.self_attn.q_proj.weight")
        k = self._shape(f"{prefix}layers.0.self_attn.k_proj.weight")
        gate = self._shape(f"{prefix}layers.0.mlp.gate_proj.weight")
        return {"width": q[1], "depth": self._layers(f"{prefix}layers."), "mlp_dim": gate[0],
                "num_heads": q[0] // k[0], "num_kv_heads": 1, "head_dim": k[0]}

    def sizes(self) -> dict[str, dict[str, int]]:
        """The language model's, the action expert's and the vision tower's sizes, read from the
        weights and checked against the variants ``config.json`` names."""
        text, expert = self._gemma(f"{VLM}model.language_model."), self._gemma(f"{EXPERT}model.")
        wrong = []
        for key, sizes in (("paligemma_variant", text), ("action_expert_variant", expert)):
            variant = self.config.get(key)
            if variant is None:
                continue
            if variant not in VARIANTS:
                raise ValueError(f"{self.path / CONFIG}: {key}={variant!r} is not one of LeRobot's variants "
                                 f"{sorted(VARIANTS)}")
            if VARIANTS[variant] != sizes:
                wrong.append(f"{key}={variant!r} is {VARIANTS[variant]}, the weights {sizes}")
        if wrong:
            raise ValueError(f"{self.path}: the weights do not match config.json: " + "; ".join(wrong))
        vision = f"{VLM}model.vision_tower.vision_model."
        patch = self._shape(f"{vision}embeddings.patch_embedding.weight")
        positions = self._shape(f"{vision}embeddings.position_embedding.weight")[0]
        height, width = (int(v) for v in self.config.get("image_resolution", (224, 224)))
        if height != width or (height // patch[-1]) ** 2 != positions:
            raise ValueError(f"{self.path}: image_resolution {[height, width]} does not fit the vision tower's "
                             f"{positions} positions of {patch[-1]}-pixel patches")
        vocab = self.shapes.get(f"{VLM}lm_head.weight") or self._shape(
            f"{VLM}model.language_model.embed_tokens.weight")
        return {"text": {**text, "vocab": vocab[0]}, "expert": expert,
                "vision": {"hidden": patch[0], "patch": patch[-1], "image": height,
                           "depth": self._layers(f"{vision}encoder.layers."),
                           "mlp_dim": self._shape(f"{vision}encoder.layers.0.mlp.fc1.weight")[0],
                           "projection": self._shape(f"{VLM}model.multi_modal_projector.linear.weight")[0]}}

    def hf_config(self, image_token_id: int):
        """transformers' ``PI0Config`` / ``PI05Config`` of this checkpoint."""
        import transformers

        s = self.sizes()
        text, expert, vision = s["text"], s["expert"], s["vision"]

        def gemma(sizes: dict[str, int]) -> dict[str, Any]:
            return {"model_type": "gemma", "hidden_size": sizes["width"], "intermediate_size": sizes["mlp_dim"],
                    "num_hidden_layers": sizes["depth"], "num_attention_heads": sizes["num_heads"],
                    "num_key_value_heads": sizes["num_kv_heads"], "head_dim": sizes["head_dim"]}

        vlm = {"model_type": "paligemma", "text_config": {**gemma(text), "vocab_size": text["vocab"]},
               "vision_config": {"model_type": "siglip_vision_model", "hidden_size": vision["hidden"],
                                 "intermediate_size": vision["mlp_dim"], "num_hidden_layers": vision["depth"],
                                 "num_attention_heads": VISION_HEADS, "image_size": vision["image"],
                                 "patch_size": vision["patch"], "vision_use_head": False},
               "projection_dim": vision["projection"], "image_token_id": int(image_token_id),
               "vocab_size": text["vocab"]}
        c = self.config
        kw = {k: c[k] for k in ("chunk_size", "max_action_dim", "num_inference_steps", "time_sampling_beta_alpha",
                                "time_sampling_beta_beta", "time_sampling_scale", "time_sampling_offset",
                                "min_period", "max_period") if c.get(k) is not None}
        if self.kind == "pi0":
            kw["max_state_dim"] = int(c.get("max_state_dim", 32))
        cls = transformers.PI0Config if self.kind == "pi0" else transformers.PI05Config
        return cls(vlm_config=vlm, dit_config=gemma(expert), **kw)

    def tokenizer(self, directory: str | Path | None = None):
        """The tokenizer in ``directory`` (or this folder, where an export left one); none is one
        :class:`FileNotFoundError` naming the one the checkpoint's preprocessor names."""
        from transformers import AutoTokenizer

        if directory is None and any((self.path / n).is_file() for n in TOKENIZER_FILES):
            directory = self.path
        if directory is None:
            name = next((s.get("config", {}).get("tokenizer_name") for s in self.preprocessor.get("steps", [])
                         if s.get("registry_name") == "tokenizer_processor"), None) or PALIGEMMA_TOKENIZER
            raise FileNotFoundError(
                f"{self.path} is a LeRobot policy folder, which holds no tokenizer; its preprocessor names {name!r}. "
                f"Pass a local copy: tokenizer=DIR (--set policy.tokenizer=DIR), e.g. from `hf download {name} "
                f"--include 'tokenizer*' --local-dir DIR` on a machine with access ({NEVER_DOWNLOADS})")
        directory = Path(directory).expanduser()
        if not any((directory / n).is_file() for n in TOKENIZER_FILES):
            raise FileNotFoundError(f"tokenizer directory {str(directory)!r} has no tokenizer files (one of "
                                    f"{', '.join(TOKENIZER_FILES)}) ({NEVER_DOWNLOADS})")
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)

    def norm(self, feature: str, feature_type: str) -> FeatureNorm:
        """``feature``'s normalisation as the pipelines apply it: the state's by the
        preprocessor's normaliser, the action's by the postprocessor's unnormaliser. A mode
        without statistics leaves the values as they are, as LeRobot's steps do (with a warning)."""
        pipeline, step_name = ((self.postprocessor, "unnormalizer_processor") if feature == ACTION
                               else (self.preprocessor, "normalizer_processor"))
        step = next((s for s in pipeline.get("steps", []) if s.get("registry_name") == step_name), None)
        config = (step or {}).get("config", {})
        norm_map = config.get("norm_map") or self.config.get("normalization_mapping") or {}
        mode = NormalizationMode(norm_map.get(feature_type, "IDENTITY"))
        stats: dict[str, Tensor] = {}
        if step is not None and step.get("state_file"):
            from safetensors.torch import load_file

            for key, value in load_file(str(self.path / step["state_file"])).items():
                name, stat = key.rsplit(".", 1)
                if name == feature:
                    stats[stat] = value.float()
        if mode is not NormalizationMode.IDENTITY and not stats:
            warnings.warn(f"{self.path}: {feature} is {mode.value}-normalised but the pipeline has no statistics "
                          "for it: it is used as it is, as LeRobot does", stacklevel=3)
            mode = NormalizationMode.IDENTITY
        return FeatureNorm(mode, stats, float(config.get("eps", EPS)))

    def processing(self, model_config) -> dict[str, Any]:
        """The fields of this folder's :class:`~ebrl.policies.pi0.preprocessing.Processing`."""
        vision = model_config.vlm_config.vision_config
        resolution = tuple(int(v) for v in self.config.get("image_resolution", (224, 224)))
        tokens = (int(vision.image_size) // int(vision.patch_size)) ** 2
        default_length = 48 if self.kind == "pi0" else 200
        return {"images": LeRobotImages(resolution, tokens), "state": self.norm(OBS_STATE, "STATE"),
                "actions": self.norm(ACTION, "ACTION"), "max_state_dim": int(self.config.get("max_state_dim", 32)),
                "max_length": int(self.config.get("tokenizer_max_length", default_length)), "bins_padded": True}

    def load(self, dtype: torch.dtype, image_token_id: int):
        """transformers' model: the weights through its conversion, every one of them used
        (``image_token_id``: the tokenizer's, as the processor leaves it)."""
        import transformers

        config = self.hf_config(image_token_id)
        cls = (transformers.PI0ForConditionalGeneration if self.kind == "pi0"
               else transformers.PI05ForConditionalGeneration)
        model, info = cls.from_pretrained(str(self.path), config=config, local_files_only=True, dtype=dtype,
                                          output_loading_info=True)
        unread = {"model.dit.embed_tokens.weight"} if self.kind == "pi05" else set()  # LeRobot's expert lm_head
        bad = {k: sorted(set(v) - unread) for k, v in info.items()
               if k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        bad = {k: v for k, v in bad.items() if v}
        if bad:
            raise ValueError(f"{self.path / WEIGHTS} does not fit a {self.kind} of the sizes read from it: "
                             + "; ".join(f"{k} {v[:5]}{' ...' if len(v) > 5 else ''}" for k, v in bad.items()))
        return model


# ---- out ---------------------------------------------------------------------------------------

def merged_state_dict(policy) -> dict[str, Tensor]:
    """The policy's transformers model as a plain state dict (transformers' names), LoRA merged."""
    from peft.tuners.lora import LoraLayer

    model = policy.hf_model
    out: dict[str, Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            base = module.get_base_layer()
            delta = sum(module.get_delta_weight(a) for a in module.active_adapters if a in module.lora_A)
            out[f"{name}.weight"] = (base.weight.detach().float() + delta.float()).to(base.weight.dtype)
            if base.bias is not None:
                out[f"{name}.bias"] = base.bias.detach()
    for key, value in model.state_dict().items():
        if ".lora_" in key or ".base_layer." in key:
            continue
        out[key] = value.detach()
    return {k: v.cpu().contiguous() for k, v in out.items()}


def lerobot_names(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """transformers' π0 parameter names -> LeRobot's: the inverse of transformers' conversion
    mapping ``pi0`` (with PaliGemma's, which drops SigLIP's ``vision_model``), each tied embedding
    written as LeRobot saves it (its ``lm_head``)."""
    out = {}
    for key, value in state.items():
        if key == "model.vlm.language_model.embed_tokens.weight":
            new = f"{VLM}lm_head.weight"
        elif key == "model.dit.embed_tokens.weight":
            new = f"{EXPERT}lm_head.weight"
        elif key.startswith("model.vlm.vision_tower."):  # LeRobot's SiglipVisionModel keeps its vision_model
            new = f"{VLM}model.vision_tower.vision_model." + key.removeprefix("model.vlm.vision_tower.")
        elif key.startswith("model.vlm."):
            new = f"{VLM}model." + key.removeprefix("model.vlm.")
        elif key.startswith("model.dit."):
            new = f"{EXPERT}model." + key.removeprefix("model.dit.")
        elif key.startswith("embed_action_time."):
            new = "model." + key.removeprefix("embed_action_time.")
        elif key.startswith("action_out_proj."):
            new = "model." + key
        else:
            raise ValueError(f"no LeRobot name for the π0 parameter {key!r}")
        out[new] = value
    return out


def _feature_names(policy, source: Mapping[str, Any] | None) -> tuple[dict[str, dict[str, Any]],
                                                                      dict[str, dict[str, Any]]]:
    """``(input_features, output_features)`` of the policy: its ``source`` LeRobot config's
    where it came from a LeRobot folder, else named after the env's entries."""
    if source is not None:
        return dict(source.get("input_features") or {}), dict(source.get("output_features") or {})
    inputs: dict[str, dict[str, Any]] = {}
    for e in policy.obs_layout.images:
        inputs[f"{OBS_IMAGES}.{e.key}"] = {"type": "VISUAL", "shape": list(e.chw)}
    if policy.state_dim:
        inputs[OBS_STATE] = {"type": "STATE", "shape": [policy.state_dim]}
    return inputs, {ACTION: {"type": "ACTION", "shape": [policy.action_dim]}}


def lerobot_config(kind: str, model_config, inputs: Mapping[str, Any], outputs: Mapping[str, Any], *,
                   state_mode: str, action_mode: str, max_state_dim: int, tokenizer_max_length: int | None = None,
                   dtype: str = "float32", source: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``config.json`` as LeRobot's ``PI0Config`` / ``PI05Config`` dumps it (draccus, in the
    dataclasses' field order: ``PreTrainedConfig``'s, then the policy's own). ``source``: the
    config of the folder the policy came from, whose settings EBRL does not change (training
    settings, ``n_action_steps``, ``empty_cameras``, ...) are kept."""
    cfg, source = model_config, dict(source or {})
    image = int(cfg.vlm_config.vision_config.image_size)
    variants = {}
    for key, sub in (("paligemma_variant", cfg.vlm_config.text_config), ("action_expert_variant", cfg.dit_config)):
        sizes = {"width": sub.hidden_size, "depth": sub.num_hidden_layers, "mlp_dim": sub.intermediate_size,
                 "num_heads": sub.num_attention_heads, "num_kv_heads": sub.num_key_value_heads,
                 "head_dim": sub.head_dim}
        variants[key] = next((name for name, v in VARIANTS.items() if v == sizes), None)
    config = {
        "type": kind, "n_obs_steps": 1, "input_features": dict(inputs), "output_features": dict(outputs),
        "device": None, "use_amp": False, "use_peft": False, "push_to_hub": False, "repo_id": None,
        "private": None, "tags": None, "license": None, "pretrained_path": None, **variants,
        "dtype": "bfloat16" if dtype == "bfloat16" else "float32",
        "chunk_size": int(cfg.chunk_size), "n_action_steps": int(cfg.chunk_size), "max_state_dim": int(max_state_dim),
        "max_action_dim": int(cfg.max_action_dim), "num_inference_steps": int(cfg.num_inference_steps),
        "time_sampling_beta_alpha": float(cfg.time_sampling_beta_alpha),
        "time_sampling_beta_beta": float(cfg.time_sampling_beta_beta),
        "time_sampling_scale": float(cfg.time_sampling_scale), "time_sampling_offset": float(cfg.time_sampling_offset),
        "min_period": float(cfg.min_period), "max_period": float(cfg.max_period), "rtc_config": None,
        "image_resolution": [image, image], "empty_cameras": 0,
        "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": state_mode, "ACTION": action_mode},
        "gradient_checkpointing": False, "compile_model": False, "compile_mode": "max-autotune",
        "freeze_vision_encoder": False, "train_expert_only": False, "optimizer_lr": 2.5e-05,
        "optimizer_betas": [0.9, 0.95], "optimizer_eps": 1e-08, "optimizer_weight_decay": 0.01,
        "optimizer_grad_clip_norm": 1.0, "scheduler_warmup_steps": 1000, "scheduler_decay_steps": 30000,
        "scheduler_decay_lr": 2.5e-06,
        "tokenizer_max_length": int(tokenizer_max_length or (48 if kind == "pi0" else 200))}
    keep = ("n_obs_steps", "device", "use_amp", "push_to_hub", "repo_id", "private", "tags", "license",
            "n_action_steps", "rtc_config", "image_resolution", "empty_cameras", "gradient_checkpointing",
            "compile_model", "compile_mode", "freeze_vision_encoder", "train_expert_only", "optimizer_lr",
            "optimizer_betas", "optimizer_eps", "optimizer_weight_decay", "optimizer_grad_clip_norm",
            "scheduler_warmup_steps", "scheduler_decay_steps", "scheduler_decay_lr")
    config.update({k: source[k] for k in keep if k in source})
    if kind == "pi05":  # PI05Config declares tokenizer_max_length first after empty_cameras (and again last)
        items = [(k, v) for k, v in config.items() if k != "tokenizer_max_length"]
        at = [k for k, _ in items].index("empty_cameras") + 1
        config = dict(items[:at] + [("tokenizer_max_length", config["tokenizer_max_length"])] + items[at:])
    if config["paligemma_variant"] is None or config["action_expert_variant"] is None:
        # sizes of no LeRobot variant (a tiny test model): left out, as LeRobot would refuse them
        del config["paligemma_variant"], config["action_expert_variant"]
    return config


def _stats_file(stats: Mapping[str, Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """LeRobot's flat ``{"<feature>.<statistic>": tensor}``."""
    return {f"{feature}.{stat}": torch.as_tensor(value).detach().cpu().float().contiguous()
            for feature, by_stat in stats.items() for stat, value in by_stat.items()}


def write_folder(out: Path, config: Mapping[str, Any], hf_state: Mapping[str, Tensor],
                 stats: Mapping[str, Mapping[str, Tensor]]) -> None:
    """``config.json``, ``model.safetensors`` (LeRobot's names) and both processor pipelines, as
    LeRobot's ``make_pi0(5)_pre_post_processors`` build them and
    ``DataProcessorPipeline.save_pretrained`` writes them: ``stats`` (``{feature: {statistic:
    tensor}}``, LeRobot's names) in safetensors beside them."""
    from safetensors.torch import save_file

    weights = lerobot_names(hf_state)
    expert_head = f"{EXPERT}lm_head.weight"
    if expert_head not in weights:
        # π0.5's expert in LeRobot is a GemmaForCausalLM whose lm_head nothing reads (transformers' PI05
        # drops it) but LeRobot's strict loading wants: zeros of its shape
        vocab = weights[f"{VLM}lm_head.weight"].shape[0]
        width = weights[f"{EXPERT}model.layers.0.self_attn.q_proj.weight"].shape[1]
        weights[expert_head] = torch.zeros(vocab, width, dtype=weights[f"{VLM}lm_head.weight"].dtype)
    save_file(weights, str(out / WEIGHTS), metadata={"format": "pt"})
    (out / CONFIG).write_text(json.dumps(config, indent=4))
    features = {**config["input_features"], **config["output_features"]}
    norm_map = config["normalization_mapping"]
    normalizer = {"registry_name": "normalizer_processor",
                  "config": {"eps": EPS, "features": features, "norm_map": norm_map}}
    tokenizer = {"registry_name": "tokenizer_processor",
                 "config": {"max_length": config["tokenizer_max_length"], "task_key": "task", "padding_side": "right",
                            "padding": "max_length", "truncation": True, "tokenizer_name": PALIGEMMA_TOKENIZER}}
    device = {"registry_name": "device_processor", "config": {"device": config["device"] or "cpu",
                                                             "float_dtype": None}}
    head = [{"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
            {"registry_name": "to_batch_processor", "config": {}}]
    if config["type"] == "pi0":
        steps = [*head, {"registry_name": "pi0_new_line_processor", "config": {}}, tokenizer, device, normalizer]
    else:
        steps = [*head, normalizer, {"registry_name": "pi05_prepare_state_tokenizer_processor_step", "config": {}},
                 tokenizer, device]
    unnormalizer = {"registry_name": "unnormalizer_processor",
                    "config": {"eps": EPS, "features": dict(config["output_features"]), "norm_map": norm_map}}
    post_steps = [unnormalizer, {"registry_name": "device_processor", "config": {"device": "cpu",
                                                                                 "float_dtype": None}}]
    stats = {"normalizer_processor": _stats_file({k: v for k, v in stats.items() if k in (OBS_STATE, ACTION)}),
             "unnormalizer_processor": _stats_file({k: v for k, v in stats.items() if k == ACTION})}
    for name, pipeline_steps in ((PREPROCESSOR, steps), (POSTPROCESSOR, post_steps)):
        for i, step in enumerate(pipeline_steps):
            if stats.get(step["registry_name"]):
                step["state_file"] = f"{name}_step_{i}_{step['registry_name']}.safetensors"
                save_file(stats[step["registry_name"]], str(out / step["state_file"]))
        (out / f"{name}.json").write_text(json.dumps({"name": name, "steps": pipeline_steps}, indent=2))


def _fresh(out: str | Path) -> Path:
    out = Path(out).expanduser()
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty: export writes a new folder")
    out.mkdir(parents=True, exist_ok=True)
    return out


def save_lerobot(policy, out: str | Path) -> Path:
    """Write ``policy`` (a :class:`~ebrl.policies.pi0.policy.PI0Policy`) as a LeRobot policy folder in
    the new directory ``out``: ``config.json``, ``model.safetensors`` (LoRA merged, LeRobot's
    names), both processor pipelines with their statistics, and the tokenizer."""
    out = _fresh(out)
    source = _lerobot_config_of(policy.config.get("base_path"))
    inputs, outputs = _feature_names(policy, source)
    config = lerobot_config(policy.kind, policy.hf_model.config, inputs, outputs,
                            state_mode=policy.state_norm.mode.value, action_mode=policy.action_norm.mode.value,
                            max_state_dim=policy.max_state_dim,
                            tokenizer_max_length=policy.max_length if source else None,
                            dtype=policy.config.get("dtype", "float32"), source=source)
    stats = {OBS_STATE: policy.state_norm.stats(), ACTION: policy.action_norm.stats()}
    write_folder(out, config, merged_state_dict(policy), {k: v for k, v in stats.items() if v})
    policy.tokenizer.save_pretrained(str(out))
    return out


def save_transformers(policy, out: str | Path) -> Path:
    """Write ``policy`` in transformers' own layout in the new directory ``out``: the model
    (LoRA merged), its tokenizer and ``PI0Processor`` / ``PI05Processor`` with the statistics."""
    import transformers

    from ebrl.policies.hf_backbone import pil_pi0_image_processor

    if policy.kind == "pi05" and policy.bins_padded:
        raise ValueError("this π0.5 reads its state in the prompt padded to max_state_dim (LeRobot's "
                         "Pi05PrepareStateTokenizerProcessorStep); transformers' PI05Processor bins it unpadded, which "
                         "would change every prompt: export it with --format lerobot")
    out = _fresh(out)
    if isinstance(policy.images, LeRobotImages):
        warnings.warn("transformers' PI0ImageProcessor resizes with PIL's bicubic filter; LeRobot's π0 resized "
                      "bilinearly: served through transformers, frames of another size than "
                      f"{policy.images.output_size(0, 0)} are prepared slightly differently", stacklevel=2)
    stats: dict[str, Any] = {}
    for feature, norm in (("state", policy.state_norm), ("actions", policy.action_norm)):
        mode = norm.mode
        if mode is NormalizationMode.MEAN_STD or (mode is NormalizationMode.QUANTILES and policy.kind == "pi05"):
            stats.update({f"{feature}_{k}": v.tolist() for k, v in norm.stats().items()})
        elif mode is not NormalizationMode.IDENTITY or feature == "actions":
            raise ValueError(f"transformers' {policy.kind} processor normalises with mean/std"
                             f"{' or quantiles' if policy.kind == 'pi05' else ''}; this policy's {feature} are "
                             f"{mode.value}: export it with --format lerobot")
    from safetensors.torch import save_file

    policy.hf_model.config.save_pretrained(str(out))
    save_file(merged_state_dict(policy), str(out / WEIGHTS), metadata={"format": "pt"})
    prefix = "PI0" if policy.kind == "pi0" else "PI05"
    size = int(policy.hf_model.config.vlm_config.vision_config.image_size)

    images = pil_pi0_image_processor(size={"max_height": size, "max_width": size},
                                     pad_size={"height": size, "width": size},
                                     image_seq_length=policy.images.image_seq_length)
    processor = getattr(transformers, prefix + "Processor")(
        image_processor=images, tokenizer=policy.tokenizer, max_state_dim=policy.max_state_dim,
        chunk_size=policy.chunk_size, **stats)
    processor.save_pretrained(str(out))
    return out


__all__ = ["LeRobotFolder", "LeRobotImages", "is_lerobot_config", "is_lerobot_policy", "lerobot_config",
           "lerobot_names", "merged_state_dict", "save_lerobot", "save_transformers", "weight_shapes", "write_folder"]
