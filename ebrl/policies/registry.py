"""Policy kinds by name: what ``--set policy.kind=NAME`` builds.

A kind is a builder ``builder(observation_space, action_space, **options) -> policy`` (a class's
``from_spaces`` is one); the ``[policy]`` table's other keys are its ``options``. EBRL's own kinds
are registered here; a user's model joins them with :func:`register_policy`, from the script or
module that defines it (``ebrl train --import mymodule`` imports one before the run is built):

    >>> import gymnasium as gym
    >>> from ebrl.policies import MLPPolicy, build_policy, register_policy, unregister_policy
    >>> def small_mlp(observation_space, action_space, **options):
    ...     return MLPPolicy.from_spaces(observation_space, action_space, hidden=(16,), **options)
    >>> register_policy("small-mlp", small_mlp)
    >>> policy = build_policy("small-mlp", gym.spaces.Box(-1, 1, (3,)), gym.spaces.Box(-1, 1, (2,)), seed=1)
    >>> [tuple(p.shape) for p in policy.actor.parameters()][:1]
    [(16, 3)]
    >>> unregister_policy("small-mlp")
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ebrl.policies.cnn import CNNPolicy
from ebrl.policies.flow import FlowPolicy
from ebrl.policies.mlp import MLPPolicy
from ebrl.policies.token import TokenPolicy

PolicyBuilder = Callable[..., Any]

_BUILDERS: dict[str, PolicyBuilder] = {}
BUILTIN_KINDS = ("mlp", "cnn", "token", "flow", "hf", "hf-token", "hf-flow")


def register_policy(kind: str, builder: PolicyBuilder, *, replace: bool = False) -> None:
    """Make ``policy.kind=kind`` build ``builder(observation_space, action_space, **options)``.

    A class with a ``from_spaces`` classmethod may be given itself. Registering a taken name is
    an error unless ``replace=True``; EBRL's own kinds cannot be replaced."""
    if not isinstance(kind, str) or not kind or kind == "auto":
        raise ValueError(f"policy kind must be a non-empty string other than 'auto', got {kind!r}")
    if isinstance(builder, type) and hasattr(builder, "from_spaces"):
        builder = builder.from_spaces
    if not callable(builder):
        raise TypeError(f"register_policy({kind!r}, ...): the builder must be callable, got {builder!r}")
    if kind in BUILTIN_KINDS:
        raise ValueError(f"policy kind {kind!r} is EBRL's own; register yours under another name")
    if kind in _BUILDERS and not replace:
        raise ValueError(f"policy kind {kind!r} is already registered; pass replace=True to replace it")
    _BUILDERS[kind] = builder


def unregister_policy(kind: str) -> None:
    """Forget a kind registered by :func:`register_policy` (tests, notebooks)."""
    if kind in BUILTIN_KINDS:
        raise ValueError(f"policy kind {kind!r} is EBRL's own and cannot be removed")
    _BUILDERS.pop(kind, None)


def policy_kinds() -> tuple[str, ...]:
    """Every name ``policy.kind`` accepts: ``auto``, EBRL's kinds, then the registered ones."""
    return ("auto", *BUILTIN_KINDS, *sorted(_BUILDERS))


def _builtin(kind: str) -> PolicyBuilder:
    # imported here: hf-token and hf-flow pull in transformers, which a user of the MLP never needs
    if kind == "hf":
        return _hf
    if kind == "hf-token":
        return _hf_token
    if kind == "hf-flow":
        return _hf_flow
    return {"mlp": MLPPolicy, "cnn": CNNPolicy, "token": TokenPolicy, "flow": FlowPolicy}[kind].from_spaces


PI0_MODEL_TYPES = ("pi0", "pi05")


def from_pretrained(path, observation_space, action_space, **options):
    """The policy for a checkpoint in the local directory ``path``, chosen by its
    ``config.json``'s ``model_type``: ``pi0`` / ``pi05`` give
    :class:`~ebrl.policies.pi0.policy.PI0Policy` on the checkpoint's own model (action expert included),
    and so does a LeRobot π0 / π0.5 policy folder (``"type": "pi0"`` / ``"pi05"``,
    :mod:`ebrl.policies.pi0.lerobot`); a LeRobot SmolVLA folder (``"type": "smolvla"``) gives
    :class:`~ebrl.policies.smolvla.policy.SmolVLAPolicy` (with ``vlm=DIR``, its SmolVLM's local copy);
    a causal LM or an image-text model gives :class:`~ebrl.policies.hf_token.HFTokenPolicy`.
    ``options`` go to that class's ``from_pretrained``. Local files only: a missing directory or
    ``config.json`` is one ``FileNotFoundError`` naming it. ``policy.kind=hf`` with
    ``policy.path=DIR`` calls this.

        >>> import gymnasium as gym
        >>> from ebrl.policies import from_pretrained
        >>> from_pretrained("/models/not-there", gym.spaces.Box(-1, 1, (3,)), gym.spaces.Box(-1, 1, (2,)))
        Traceback (most recent call last):
        ...
        FileNotFoundError: from_pretrained: model directory '/models/not-there' does not exist (EBRL loads local ...
    """
    import json
    from pathlib import Path

    from ebrl.policies.hf_backbone import NEVER_DOWNLOADS

    root = Path(path).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"from_pretrained: model directory {str(root)!r} does not exist ({NEVER_DOWNLOADS})")
    config = root / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"from_pretrained: {str(config)!r} does not exist ({NEVER_DOWNLOADS})")
    from ebrl.policies.pi0.lerobot import is_lerobot_config

    parsed = json.loads(config.read_text())
    model_type = parsed.get("model_type")
    if model_type in PI0_MODEL_TYPES or is_lerobot_config(parsed):
        from ebrl.policies.pi0.policy import PI0Policy

        return PI0Policy.from_pretrained(root, observation_space, action_space, **options)
    from ebrl.policies.smolvla.lerobot import is_smolvla_config

    if is_smolvla_config(parsed):
        from ebrl.policies.smolvla.policy import SmolVLAPolicy

        return SmolVLAPolicy.from_pretrained(root, observation_space, action_space, **options)
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from ebrl.policies.hf_backbone import is_image_text

    try:
        hf_config = AutoConfig.from_pretrained(str(root), local_files_only=True)
    except (ValueError, KeyError) as exc:
        raise ValueError(f"from_pretrained: {str(config)!r} has model_type {model_type!r}, which this transformers "
                         f"does not know ({exc})") from None
    if is_image_text(hf_config) or type(hf_config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        from ebrl.policies.hf_token import HFTokenPolicy

        return HFTokenPolicy.from_pretrained(root, observation_space, action_space, **options)
    raise ValueError(f"from_pretrained: {str(root)!r} holds a {model_type!r} model; EBRL loads π0 / π0.5 "
                     f"({', '.join(PI0_MODEL_TYPES)}), causal LMs and image-text models")


def _hf(observation_space, action_space, path=None, **options):
    if path is None:
        raise ValueError("policy.kind=hf needs policy.path: the local directory of a Hugging Face checkpoint "
                         "(π0 / π0.5, a LeRobot SmolVLA folder, a causal LM or an image-text model)")
    return from_pretrained(path, observation_space, action_space, **options)


def _hf_token(observation_space, action_space, path=None, **options):
    if path is None:
        raise ValueError("policy.kind=hf-token needs policy.path: the local directory of a Hugging Face model")
    from ebrl.policies.hf_token import HFTokenPolicy

    return HFTokenPolicy.from_pretrained(path, observation_space, action_space, **options)


def _hf_flow(observation_space, action_space, path=None, **options):
    if path is None:
        raise ValueError("policy.kind=hf-flow needs policy.path: the local directory of a Hugging Face model")
    from ebrl.policies.hf_flow import HFFlowPolicy

    return HFFlowPolicy.from_pretrained(path, observation_space, action_space, **options)


def policy_builder(kind: str) -> PolicyBuilder:
    """The builder of ``kind``; an unknown kind is a ``KeyError`` listing the known ones."""
    if kind in BUILTIN_KINDS:
        return _builtin(kind)
    if kind in _BUILDERS:
        return _BUILDERS[kind]
    raise KeyError(f"unknown policy kind {kind!r}; known: {', '.join(policy_kinds())} "
                   f"(register your own with ebrl.policies.register_policy)")


def build_policy(kind: str, observation_space, action_space, **options):
    """Build a policy of ``kind`` for these spaces (``auto`` is the CLI's choice, not a kind here)."""
    return policy_builder(kind)(observation_space, action_space, **options)
