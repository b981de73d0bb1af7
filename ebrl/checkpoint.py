"""Checkpoints: the policy's weights and the algorithm's state, written atomically.

``ebrl train`` writes ``checkpoint.pt`` into its run directory when a run ends, also when it
is stopped by Ctrl-C or SIGTERM (the first signal stops generating, finishes the update in
flight and saves; a second one aborts), and ``ebrl train --resume PATH`` continues from one.
With ``RunConfig.checkpoint_every_s`` (and ``log_dir``) the runtime also writes
``log_dir/checkpoint.pt`` during the run, after an update at most that often. In your own
scripts::

    >>> import ebrl, tempfile, os
    >>> from ebrl.checkpoint import load_checkpoint, save_checkpoint
    >>> from ebrl.algos import PPO
    >>> from ebrl.policies import MLPPolicy
    >>> from ebrl.testing import MockEnv
    >>> make = lambda: ebrl.Trainer(lambda i: MockEnv(), MLPPolicy(3, 4, seed=0), PPO())
    >>> tmp = tempfile.TemporaryDirectory()
    >>> path = os.path.join(tmp.name, "checkpoint.pt")
    >>> save_checkpoint(path, make(), env_steps=1000)
    >>> trainer = make()
    >>> load_checkpoint(path, trainer)["env_steps"]
    1000
    >>> tmp.cleanup()
"""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

FORMAT = 1


def save_checkpoint(path: str | os.PathLike, trainer, **meta: Any) -> None:
    """Write ``trainer.policy``'s and ``trainer.algo``'s state and ``meta`` (e.g. ``env_steps``) to ``path``.

    Written to a temporary file first and renamed, so a crash never leaves half a checkpoint.
    A policy with a frozen part (``trainable_state_dict``, e.g. a LoRA-tuned backbone) saves only
    what trains; its frozen base is loaded from where it came from.
    """
    from ebrl.policies.base import published_state

    write_checkpoint(path, published_state(trainer.policy), algo_state(trainer.algo), type(trainer.policy).__name__,
                     **meta)


def algo_state(algo) -> dict | None:
    return algo.state_dict() if callable(getattr(algo, "state_dict", None)) else None


def write_checkpoint(path: str | os.PathLike, policy_state: dict, algo_state: dict | None, policy_class: str,
                     **meta: Any) -> None:
    """:func:`save_checkpoint` from states already taken (the runtime's periodic checkpoints)."""
    path = Path(path)
    data = {"format": FORMAT, "policy": policy_state, "algo": algo_state, "policy_class": policy_class, "meta": meta}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        torch.save(data, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_safely(path: str | os.PathLike, allow: tuple = ()) -> Any:
    """``torch.load`` of ``path`` with ``weights_only=True``: tensors, containers, numbers and
    strings, plus the types in ``allow``, and nothing that runs code while it loads (a pickled
    ``os.system`` call is refused, not run). A checkpoint holds only those: the policy's and
    the optimiser's tensors, PPO's scalars and its RNG state as a tensor.

    Raises ``ValueError`` naming the file and what is wrong with it (objects a checkpoint never
    holds, or a truncated or corrupt file)."""
    try:
        with torch.serialization.safe_globals(list(allow)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's message is a page long; the line that matters names the refused global
        refused = [ln.strip() for ln in str(exc).splitlines() if "global" in ln.lower()]
        if refused:
            raise ValueError(f"{path} holds objects a checkpoint never does and was not loaded ({refused[0]})") from None
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        raise ValueError(f"{path} is not a readable checkpoint (truncated or corrupt: {first})") from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, KeyError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"{path} is not a readable checkpoint (truncated or corrupt: {first})") from None


def load_checkpoint(path: str | os.PathLike, trainer) -> dict[str, Any]:
    """Load a checkpoint into ``trainer.policy`` and ``trainer.algo``; returns its ``meta``.

    ``trainer.env_steps_done`` becomes the checkpoint's ``env_steps``, so checkpoints the
    continued run writes count from there. A checkpoint of another policy class or shape
    raises ``ValueError`` naming both; so does one whose algorithm state lacks a key (named), a
    file that is not a checkpoint, a truncated one, or one holding anything but states (loaded
    with :func:`load_safely`: nothing in the file runs).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    data = load_safely(path)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path} is not an EBRL checkpoint (format {FORMAT})")
    ours = type(trainer.policy).__name__
    if data["policy_class"] != ours:
        raise ValueError(f"{path} holds a {data['policy_class']}, the trainer's policy is a {ours}")
    from ebrl.policies.base import load_published

    try:
        load_published(trainer.policy, data["policy"])
    except RuntimeError as exc:  # torch names the missing keys and shape mismatches
        raise ValueError(f"{path} does not fit the trainer's {ours}: {exc}") from None
    if data["algo"] is not None and callable(getattr(trainer.algo, "load_state_dict", None)):
        try:
            trainer.algo.load_state_dict(data["algo"])
        except KeyError as exc:
            raise ValueError(f"{path}: the {type(trainer.algo).__name__} state lacks {exc}") from None
    trainer.env_steps_done = int(data["meta"].get("env_steps", 0))
    return data["meta"]
