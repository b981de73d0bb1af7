"""A saved policy by its directory: an ``ebrl train`` run or an ``ebrl sft`` output.

Both hold ``spec.json`` (the env, its keywords and the ``[policy]`` table it was built with)
and ``checkpoint.pt`` (the policy's weights; only what trains for a LoRA-tuned backbone, whose
base is loaded again from ``policy.path``). :func:`load_run` rebuilds the policy from the spec
and loads the weights; ``ebrl eval``, ``ebrl demos collect --policy DIR`` and
``ebrl train --set policy.init=DIR`` go through it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SPEC, CHECKPOINT = "spec.json", "checkpoint.pt"


def read_spec(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not (path / SPEC).is_file() or not (path / CHECKPOINT).is_file():
        raise FileNotFoundError(f"{path} is not a run or policy directory: it needs {SPEC} and {CHECKPOINT} "
                                "(written by ebrl train and ebrl sft)")
    return json.loads((path / SPEC).read_text())


def load_policy_weights(path: str | Path, policy) -> dict[str, Any]:
    """Load ``checkpoint.pt``'s policy weights (not the algorithm's state) into ``policy``; returns its meta."""
    from ebrl.checkpoint import FORMAT, load_safely
    from ebrl.policies.base import load_published

    file = Path(path) / CHECKPOINT if Path(path).is_dir() else Path(path)
    data = load_safely(file)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{file} is not an EBRL checkpoint (format {FORMAT})")
    ours = type(policy).__name__
    if data["policy_class"] != ours:
        raise ValueError(f"{file} holds a {data['policy_class']}, this policy is a {ours}: build it with the "
                         f"same policy.kind")
    try:
        load_published(policy, data["policy"])
    except RuntimeError as exc:
        raise ValueError(f"{file} does not fit this {ours}: {exc}") from None
    return data["meta"]


def scale_std(policy, scale: float) -> None:
    """Multiply a Gaussian policy's standard deviation by ``scale`` (``log_std += log(scale)``): RL
    from a clone whose ``log_std`` SFT fitted to its held-out error samples a policy worse than its
    mode, and RL learns from what it samples (``policy.init_std_scale``, docs/demos.md)."""
    import math

    import torch

    log_std = getattr(policy, "log_std", None)
    if not isinstance(log_std, torch.nn.Parameter):
        raise ValueError(f"{type(policy).__name__} has no Gaussian log_std to scale")
    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"the scale must be a positive number, not {scale!r}")
    with torch.no_grad():
        log_std.add_(math.log(scale))


def load_run(path: str | Path, overrides: dict[str, Any] | None = None):
    """``(spec, trainer)`` of the run or policy directory ``path``, its weights in ``trainer.policy``.

    ``overrides``: top-level spec keys to replace (``env_kwargs`` for an eval env that renders).
    """
    from ebrl.cli import build_trainer

    spec = {**read_spec(path), **(overrides or {})}
    spec.setdefault("algo", {"kind": "ppo"})
    trainer = build_trainer(spec)
    load_policy_weights(path, trainer.policy)
    return spec, trainer
