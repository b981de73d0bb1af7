"""Pieces of LeRobot's policy-folder layout that no one policy owns.

A folder ``PreTrainedPolicy.save_pretrained`` writes holds ``config.json`` (draccus' JSON dump of
the policy config, 4-space indent), ``model.safetensors`` (``safetensors.torch.save_model``:
metadata ``{"format": "pt"}``, of tensors sharing storage only the sorted-first name) and, from
``DataProcessorPipeline.save_pretrained``, ``<pipeline>.json`` (``{"name", "steps"}``, 2-space
indent) whose stateful steps keep their tensors in ``<pipeline>_step_<i>_<registry_name>.safetensors``
(no metadata). The normaliser steps' state is ``{"<feature>.<statistic>": tensor}``.

These functions write and read those files generically (:class:`PolicyFolder` reads what
every policy type's folder holds); :mod:`ebrl.policies.pi0.lerobot` has π0-specific versions of
some of them (its ``write_folder``'s pipeline part, ``_stats_file``) that could be replaced by these.

    >>> state_file_name("policy_preprocessor", 5, "normalizer_processor")
    'policy_preprocessor_step_5_normalizer_processor.safetensors'
    >>> import torch
    >>> sorted(nested_stats(flat_stats({"action": {"mean": torch.zeros(2), "std": torch.ones(2)}}))["action"])
    ['mean', 'std']
    >>> PolicyFolder.read("/models/not-there")
    Traceback (most recent call last):
    ...
    FileNotFoundError: LeRobot policy folder '/models/not-there' does not exist (EBRL loads local ...
"""

from __future__ import annotations

import dataclasses
import json
import re
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Self

import torch
from torch import Tensor

from ebrl.policies.hf_backbone import NEVER_DOWNLOADS

CONFIG, WEIGHTS = "config.json", "model.safetensors"
PREPROCESSOR, POSTPROCESSOR = "policy_preprocessor", "policy_postprocessor"


def weight_shapes(file: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in a safetensors file, from its header alone."""
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def pipeline_files(path: Path, name: str) -> tuple[dict | None, list[str]]:
    """``(pipeline, missing files)`` of ``name.json`` and the state files its steps name."""
    file = path / f"{name}.json"
    if not file.is_file():
        return None, [file.name]
    pipeline = json.loads(file.read_text())
    missing = [s["state_file"] for s in pipeline.get("steps", []) if s.get("state_file")
               and not (path / s["state_file"]).is_file()]
    return pipeline, missing


@dataclasses.dataclass
class PolicyFolder:
    """A LeRobot policy folder, read: its JSON and the weights' header (no tensor). A subclass
    names the ``config.json`` ``type`` values it reads in ``TYPES``."""

    TYPES: ClassVar[tuple[str, ...]] = ()

    path: Path
    config: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]
    preprocessor: dict[str, Any]
    postprocessor: dict[str, Any]

    @classmethod
    def read(cls, path: str | Path) -> Self:
        """The folder at ``path``: one :class:`FileNotFoundError` naming every missing file, a
        :class:`ValueError` where ``config.json``'s ``type`` is not one of ``TYPES``."""
        path = Path(path).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"LeRobot policy folder {str(path)!r} does not exist ({NEVER_DOWNLOADS})")
        missing = [n for n in (CONFIG, WEIGHTS) if not (path / n).is_file()]
        pre, more = pipeline_files(path, PREPROCESSOR)
        post, most = pipeline_files(path, POSTPROCESSOR)
        missing += more + most
        if missing:
            raise FileNotFoundError(f"LeRobot policy folder {str(path)!r} has no {', no '.join(missing)} "
                                    f"({NEVER_DOWNLOADS})")
        config = json.loads((path / CONFIG).read_text())
        if config.get("type") not in cls.TYPES:
            raise ValueError(f"{path / CONFIG} is a LeRobot {config.get('type')!r} policy; {cls.__name__} reads "
                             f"{' and '.join(cls.TYPES)}")
        return cls(path, config, weight_shapes(path / WEIGHTS), pre, post)


def state_file_name(pipeline: str, index: int, registry_name: str) -> str:
    """The file ``DataProcessorPipeline._save_pretrained`` keeps step ``index``'s state in."""
    return f"{re.sub(r'[^a-zA-Z0-9_]', '_', pipeline.lower())}_step_{index}_{registry_name}.safetensors"


def flat_stats(stats: Mapping[str, Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """``{feature: {statistic: tensor}}`` as a normaliser step's state: ``{"feature.statistic":
    float32 tensor}``."""
    return {f"{feature}.{stat}": torch.as_tensor(value).detach().cpu().float().contiguous()
            for feature, by_stat in stats.items() for stat, value in by_stat.items()}


def nested_stats(flat: Mapping[str, Tensor]) -> dict[str, dict[str, Tensor]]:
    """A normaliser step's state back as ``{feature: {statistic: tensor}}``."""
    out: dict[str, dict[str, Tensor]] = {}
    for key, value in flat.items():
        feature, stat = key.rsplit(".", 1)
        out.setdefault(feature, {})[stat] = value
    return out


def write_pipeline(out: Path, name: str, steps: Sequence[Mapping[str, Any]],
                   states: Mapping[int, Mapping[str, Tensor]]) -> None:
    """``<name>.json`` of ``steps`` (``{"registry_name", "config"}`` each), with step ``i``'s
    ``states[i]`` (where non-empty) in its state file, named in the step as ``state_file``."""
    from safetensors.torch import save_file

    entries = []
    for i, step in enumerate(steps):
        entry = dict(step)
        if states.get(i):
            entry["state_file"] = state_file_name(name, i, step["registry_name"])
            save_file({k: v.contiguous() for k, v in states[i].items()}, str(out / entry["state_file"]))
        entries.append(entry)
    (out / f"{name}.json").write_text(json.dumps({"name": name, "steps": entries}, indent=2))


def read_pipeline_states(path: Path, pipeline: Mapping[str, Any]) -> dict[int, dict[str, Tensor]]:
    """Each stateful step's tensors, by step index, as its state file holds them."""
    from safetensors.torch import load_file

    return {i: load_file(str(path / step["state_file"])) for i, step in enumerate(pipeline.get("steps", []))
            if step.get("state_file")}


def pipeline_steps(pipeline: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A pipeline's steps less their ``state_file`` entries (which :func:`write_pipeline` names)."""
    return [{k: v for k, v in step.items() if k != "state_file"} for step in pipeline.get("steps", [])]


def shared_names_dropped(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``state`` as ``safetensors.torch.save_model`` writes it: of the names of one tensor (tied
    weights) only the sorted-first kept."""
    by_storage: dict[tuple, list[str]] = {}
    for name, tensor in state.items():
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        by_storage.setdefault(key, []).append(name)
    keep = {min(names) for names in by_storage.values()}
    return {k: v for k, v in state.items() if k in keep}


def write_config(out: Path, config: Mapping[str, Any]) -> None:
    """``config.json`` as draccus dumps a policy config."""
    (out / CONFIG).write_text(json.dumps(dict(config), indent=4))


def write_weights(out: Path, state: Mapping[str, Tensor]) -> None:
    """``model.safetensors`` as LeRobot saves a policy (tied names dropped, contiguous, CPU)."""
    from safetensors.torch import save_file

    weights = {k: v.detach().cpu().contiguous() for k, v in shared_names_dropped(state).items()}
    save_file(weights, str(out / WEIGHTS), metadata={"format": "pt"})


__all__ = [
    "CONFIG",
    "POSTPROCESSOR",
    "PREPROCESSOR",
    "WEIGHTS",
    "PolicyFolder",
    "flat_stats",
    "nested_stats",
    "pipeline_files",
    "pipeline_steps",
    "read_pipeline_states",
    "shared_names_dropped",
    "state_file_name",
    "weight_shapes",
    "write_config",
    "write_pipeline",
    "write_weights",
]
