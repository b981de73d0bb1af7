"""LeRobot's SmolVLA policy folders, read into a :class:`~ebrl.policies.smolvla.model.SmolVLAModel`
and written back so that LeRobot loads them.

A folder ``SmolVLAPolicy.save_pretrained`` writes holds ``config.json`` (``"type": "smolvla"``),
``model.safetensors`` in LeRobot's names (``model.vlm_with_expert.vlm.model...``,
``model.vlm_with_expert.lm_expert.layers...``, ``model.state_proj...``, ...) and the two processor
pipelines of ``make_smolvla_pre_post_processors`` with the dataset statistics beside them. The VLM's
own configuration and tokenizer are not in it: LeRobot fetches ``vlm_model_name``
(``HuggingFaceTB/SmolVLM2-500M-Video-Instruct``); EBRL reads a local copy, ``vlm=DIR``, and
downloads nothing.

The weights' names and shapes are checked against the network the configs describe from the
safetensors header before any tensor is read. Folders read here and written back with
:func:`write_smolvla_folder` are identical byte for byte; written from scratch, ``config.json``
follows LeRobot's field order (``PreTrainedConfig``'s fields, then ``SmolVLAConfig``'s:
:data:`LEROBOT_CONFIG_DEFAULTS`).

    >>> list(LEROBOT_CONFIG_DEFAULTS)[:4]
    ['type', 'n_obs_steps', 'input_features', 'output_features']
    >>> SmolVLAFolder.read("/models/not-there")
    Traceback (most recent call last):
    ...
    FileNotFoundError: LeRobot policy folder '/models/not-there' does not exist (EBRL loads local ...
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ebrl.policies.hf_backbone import NEVER_DOWNLOADS, TOKENIZER_FILES
from ebrl.policies.lerobot_layout import (
    CONFIG,
    POSTPROCESSOR,
    PREPROCESSOR,
    WEIGHTS,
    PolicyFolder,
    pipeline_steps,
    read_pipeline_states,
    write_config,
    write_pipeline,
    write_weights,
)
from ebrl.policies.normalization import EPS, FeatureNorm
from ebrl.policies.pi0.lerobot import ACTION, OBS_IMAGES, OBS_STATE, LeRobotFolder
from ebrl.policies.smolvla.model import SmolVLAModel, SmolVLASettings

TYPE = "smolvla"
SMOLVLM = "HuggingFaceTB/SmolVLM2-500M-Video-Instruct"  # SmolVLAConfig.vlm_model_name's default
PREFIX = "model."  # SmolVLAPolicy.model: the VLAFlowMatching module

# LeRobot's SmolVLAConfig as draccus dumps it, in the dataclasses' field order: PreTrainedConfig's
# fields (n_obs_steps keeps its place though SmolVLAConfig redeclares it), then SmolVLAConfig's.
# Values are the declared defaults but push_to_hub (True there; lerobot-train then demands a repo_id).
LEROBOT_CONFIG_DEFAULTS: dict[str, Any] = {
    "type": TYPE, "n_obs_steps": 1, "input_features": {}, "output_features": {}, "device": None, "use_amp": False,
    "use_peft": False, "push_to_hub": False, "repo_id": None, "private": None, "tags": None, "license": None,
    "pretrained_path": None, "chunk_size": 50, "n_action_steps": 50,
    "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"},
    "max_state_dim": 32, "max_action_dim": 32, "resize_imgs_with_padding": [512, 512], "empty_cameras": 0,
    "adapt_to_pi_aloha": False, "use_delta_joint_actions_aloha": False, "tokenizer_max_length": 48, "num_steps": 10,
    "use_cache": True, "freeze_vision_encoder": True, "train_expert_only": True, "train_state_proj": True,
    "optimizer_lr": 1e-4, "optimizer_betas": [0.9, 0.95], "optimizer_eps": 1e-8, "optimizer_weight_decay": 1e-10,
    "optimizer_grad_clip_norm": 10, "scheduler_warmup_steps": 1000, "scheduler_decay_steps": 30000,
    "scheduler_decay_lr": 2.5e-6, "vlm_model_name": SMOLVLM, "load_vlm_weights": False,
    "add_image_special_tokens": False, "attention_mode": "cross_attn", "prefix_length": -1,
    "pad_language_to": "longest", "num_expert_layers": -1, "num_vlm_layers": 16, "self_attn_every_n_layers": 2,
    "expert_width_multiplier": 0.75, "min_period": 4e-3, "max_period": 4.0, "rtc_config": None,
    "compile_model": False, "compile_mode": "max-autotune"}


class SmolVLAFolder(PolicyFolder):
    """A LeRobot SmolVLA policy folder, read (its JSON and the weights' header; no tensor)."""

    TYPES = (TYPE,)

    # ---- features and processing ----------------------------------------------------------------

    @property
    def _layout(self) -> LeRobotFolder:
        # the π0 reader's feature and statistics code is LeRobot's generic layout: reused as it is
        return LeRobotFolder(self.path, self.config, self.shapes, self.preprocessor, self.postprocessor)

    def settings(self) -> SmolVLASettings:
        return SmolVLASettings.from_lerobot(self.config)

    def features(self) -> dict[str, dict[str, Any]]:
        return self._layout.features()

    def cameras(self) -> list[str]:
        """The camera features an env fills (empty cameras left out)."""
        return self._layout.cameras()

    def image_features(self) -> list[str]:
        """Every camera feature the model reads, in order, as ``SmolVLAConfig.validate_features``
        leaves them: the config's, then ``empty_camera_<i>`` for each it lacks."""
        inputs = self.config.get("input_features") or {}
        names = [k for k, f in inputs.items() if f.get("type") == "VISUAL"]
        return names + [k for i in range(int(self.config.get("empty_cameras", 0)))
                        if (k := f"{OBS_IMAGES}.empty_camera_{i}") not in names]

    def env_keys(self, observation_space, action_dim: int, *, feature_map: Mapping[str, str] | None = None):
        """``(image_keys, state_keys)`` of the env, as :meth:`LeRobotFolder.env_keys`: a feature
        the env lacks or mismatches is one :class:`ValueError` listing both sides."""
        return self._layout.env_keys(observation_space, action_dim, feature_map=feature_map)

    def norm(self, feature: str, feature_type: str) -> FeatureNorm:
        """``feature``'s normalisation as the pipelines apply it (state: the preprocessor's
        normaliser; action: the postprocessor's unnormaliser)."""
        return self._layout.norm(feature, feature_type)

    def processing(self) -> dict[str, Any]:
        """What the model's inputs need besides the tokenizer (:mod:`~ebrl.policies.smolvla.preprocess`)."""
        mode = (self.config.get("normalization_mapping") or {}).get("VISUAL", "IDENTITY")
        if mode != "IDENTITY":
            raise NotImplementedError(f"{self.path}: cameras normalised {mode}; EBRL reads SmolVLA's cameras "
                                      "IDENTITY-normalised only (LeRobot's default)")
        resize = self.config.get("resize_imgs_with_padding")
        return {"image_features": self.image_features(), "resize": None if resize is None else tuple(resize),
                "empty_cameras": int(self.config.get("empty_cameras", 0)),
                "max_state_dim": int(self.config.get("max_state_dim", 32)),
                "max_length": int(self.config.get("tokenizer_max_length", 48)),
                "padding": str(self.config.get("pad_language_to", "longest")),
                "state": self.norm(OBS_STATE, "STATE"), "actions": self.norm(ACTION, "ACTION")}

    # ---- the VLM and the model ------------------------------------------------------------------

    def vlm_name(self) -> str:
        return str(self.config.get("vlm_model_name") or SMOLVLM)

    def vlm_dir(self, vlm: str | Path | None) -> Path:
        """``vlm``, checked to hold the VLM's ``config.json`` and a tokenizer: else one
        :class:`FileNotFoundError` naming the VLM the checkpoint names."""
        name = self.vlm_name()
        hint = (f"{self.path} is a LeRobot SmolVLA folder built on {name!r}, whose config and tokenizer it does not "
                f"hold. Pass a local copy: vlm=DIR, e.g. from `hf download {name} --local-dir DIR` on a machine "
                f"with access ({NEVER_DOWNLOADS})")
        if vlm is None:
            raise FileNotFoundError(hint)
        directory = Path(vlm).expanduser()
        lacks = ([CONFIG] if not (directory / CONFIG).is_file() else []) + (
            [] if any((directory / n).is_file() for n in TOKENIZER_FILES) else ["tokenizer"])
        if lacks:
            raise FileNotFoundError(f"vlm directory {str(directory)!r} has no {' and no '.join(lacks)}. " + hint)
        return directory

    def vlm_config(self, vlm: str | Path | None):
        """transformers' ``SmolVLMConfig`` from ``vlm/config.json``."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(self.vlm_dir(vlm)), local_files_only=True)
        if config.model_type != "smolvlm":
            raise ValueError(f"{vlm}/config.json is a {config.model_type!r} model; {self.path} is built on SmolVLM "
                             f"({self.vlm_name()!r})")
        return config

    def tokenizer(self, vlm: str | Path | None):
        """The VLM's tokenizer (SmolVLA prepares its images itself: the VLM's image processor is not read)."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.vlm_dir(vlm)), local_files_only=True)

    def check_weights(self, vlm_config) -> None:
        """The weights' names and shapes (the header) against the model ``vlm_config`` and this
        config describe: one :class:`ValueError` listing what differs."""
        with torch.device("meta"):
            model = SmolVLAModel(vlm_config, self.settings())
        expected = {PREFIX + k: tuple(v.shape) for k, v in model.state_dict().items()}
        tied = _tied_names(model)
        missing = sorted(k for k in expected if k not in self.shapes and k.removeprefix(PREFIX) not in tied)
        unexpected = sorted(k for k in self.shapes if k not in expected)
        wrong = sorted(f"{k} {list(self.shapes[k])} (the configs make {list(v)})" for k, v in expected.items()
                       if k in self.shapes and self.shapes[k] != v)
        problems = [f"{what} {names[:4]}{' ...' if len(names) > 4 else ''}" for what, names in (
            ("lacks", missing), ("has unknown", unexpected), ("has wrong shapes:", wrong)) if names]
        if problems:
            raise ValueError(f"{self.path / WEIGHTS} does not fit the SmolVLA its config.json and the VLM's config "
                             f"describe ({self.vlm_name()}, num_vlm_layers={self.settings().num_vlm_layers}): "
                             + "; ".join(problems))

    def load_model(self, vlm: str | Path | None, dtype: torch.dtype = torch.float32) -> SmolVLAModel:
        """The model with the folder's weights, every one of them used, in ``dtype``."""
        from safetensors.torch import load_file

        vlm_config = self.vlm_config(vlm)
        self.check_weights(vlm_config)
        model = SmolVLAModel(vlm_config, self.settings())
        weights = {k.removeprefix(PREFIX): v for k, v in load_file(str(self.path / WEIGHTS)).items()}
        model.load_state_dict(weights, strict=False)  # tied names: check_weights allowed them absent
        return model.to(dtype).eval()

    def pipelines(self) -> dict[str, tuple[list[dict[str, Any]], dict[int, dict[str, Tensor]]]]:
        """Both pipelines as read: ``{name: (steps, {step index: state tensors})}``."""
        return {name: (pipeline_steps(p), read_pipeline_states(self.path, p))
                for name, p in ((PREPROCESSOR, self.preprocessor), (POSTPROCESSOR, self.postprocessor))}


def _tied_names(model: torch.nn.Module) -> set[str]:
    """The names of parameters that a sorted-earlier name shares (tied weights): those LeRobot's
    ``save_model`` leaves out."""
    by_param: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(param), []).append(name)
    return {name for names in by_param.values() for name in sorted(names)[1:]}


# ---- out ---------------------------------------------------------------------------------------

def lerobot_state_dict(model: SmolVLAModel) -> dict[str, Tensor]:
    """The model's weights in LeRobot's names (``SmolVLAPolicy``'s: ``model.`` + ours)."""
    return {PREFIX + k: v for k, v in model.state_dict().items()}


def lerobot_smolvla_config(settings: SmolVLASettings, inputs: Mapping[str, Any], outputs: Mapping[str, Any], *,
                           normalization_mapping: Mapping[str, str] | None = None,
                           source: Mapping[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
    """``config.json`` as LeRobot's ``SmolVLAConfig`` dumps it: its defaults, then ``source``'s
    values (a config read from a folder; its key order kept), then ``settings``, the features,
    ``normalization_mapping`` and ``fields``. Empty cameras are added to the inputs as
    ``validate_features`` adds them (``(3, 480, 640)``)."""
    source = dict(source or {})
    config = {**LEROBOT_CONFIG_DEFAULTS, **source} if not source else {
        **source, **{k: v for k, v in LEROBOT_CONFIG_DEFAULTS.items() if k not in source}}
    config.update(dataclasses.asdict(settings))
    config.update(fields)
    inputs = dict(inputs)
    for i in range(int(config["empty_cameras"])):
        inputs.setdefault(f"{OBS_IMAGES}.empty_camera_{i}", {"type": "VISUAL", "shape": [3, 480, 640]})
    config["input_features"], config["output_features"] = inputs, dict(outputs)
    if normalization_mapping is not None:
        config["normalization_mapping"] = dict(normalization_mapping)
    return config


def smolvla_pipelines(config: Mapping[str, Any], stats: Mapping[str, Tensor]
                      ) -> dict[str, tuple[list[dict[str, Any]], dict[int, dict[str, Tensor]]]]:
    """Both pipelines as ``make_smolvla_pre_post_processors`` builds them for ``config``, each
    normaliser holding ``stats`` (``{"<feature>.<statistic>": tensor}``: the dataset's, all of
    them, as LeRobot passes the same statistics to both)."""
    features = {**config["input_features"], **config["output_features"]}
    norm_map = dict(config["normalization_mapping"])
    pre = [{"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
           {"registry_name": "to_batch_processor", "config": {}},
           {"registry_name": "smolvla_new_line_processor", "config": {}},
           {"registry_name": "tokenizer_processor",
            "config": {"max_length": config["tokenizer_max_length"], "task_key": "task", "padding_side": "right",
                       "padding": config["pad_language_to"], "truncation": True,
                       "tokenizer_name": config["vlm_model_name"]}},
           {"registry_name": "device_processor", "config": {"device": config["device"] or "cpu", "float_dtype": None}},
           {"registry_name": "normalizer_processor", "config": {"eps": EPS, "features": features, "norm_map": norm_map}}]
    post = [{"registry_name": "unnormalizer_processor",
             "config": {"eps": EPS, "features": dict(config["output_features"]), "norm_map": norm_map}},
            {"registry_name": "device_processor", "config": {"device": "cpu", "float_dtype": None}}]
    stats = dict(stats)
    return {PREPROCESSOR: (pre, {5: stats}), POSTPROCESSOR: (post, {0: stats})}


def write_smolvla_folder(out: str | Path, config: Mapping[str, Any], weights: Mapping[str, Tensor],
                         pipelines: Mapping[str, tuple[Sequence[Mapping[str, Any]], Mapping[int, Mapping[str, Tensor]]]]
                         ) -> Path:
    """Write a LeRobot SmolVLA folder: ``config.json``, ``weights`` (LeRobot's names:
    :func:`lerobot_state_dict`) and the ``pipelines`` (:func:`smolvla_pipelines`, or
    :meth:`SmolVLAFolder.pipelines` of the folder the model came from)."""
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    if config.get("type") != TYPE:
        raise ValueError(f"write_smolvla_folder: config type {config.get('type')!r}, not {TYPE!r}")
    write_config(out, config)
    write_weights(out, weights)
    for name, (steps, states) in pipelines.items():
        write_pipeline(out, name, steps, states)
    return out


def save_smolvla_lerobot(policy, out: str | Path) -> Path:
    """Write a trained :class:`~ebrl.policies.smolvla.policy.SmolVLAPolicy` as a LeRobot SmolVLA
    folder in the new directory ``out``: the folder it was loaded from (``config.json`` and both
    pipelines with their statistics, as they were) with ``model.safetensors`` replaced by the
    trained weights, LoRA merged, in LeRobot's names. The noise and value heads are RL's alone and
    are not written (LeRobot samples with the ODE)."""
    from ebrl.policies.pi0.lerobot import _fresh, merged_state_dict

    source = SmolVLAFolder.read(policy.config["base_path"])
    out = _fresh(out)
    weights = {PREFIX + k: v for k, v in merged_state_dict(policy).items()}
    return write_smolvla_folder(out, source.config, weights, source.pipelines())


def is_smolvla_config(config: Any) -> bool:
    """Whether a parsed ``config.json`` is a LeRobot SmolVLA policy config (``type``, no ``model_type``)."""
    return isinstance(config, dict) and "model_type" not in config and config.get("type") == TYPE


__all__ = ["LEROBOT_CONFIG_DEFAULTS", "SMOLVLM", "SmolVLAFolder", "is_smolvla_config", "lerobot_smolvla_config",
           "lerobot_state_dict", "save_smolvla_lerobot", "smolvla_pipelines", "write_smolvla_folder"]
