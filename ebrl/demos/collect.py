"""Collect demonstrations: episodes of a scripted expert or a trained policy, as a LeRobot dataset.

    >>> import tempfile
    >>> from ebrl.demos import collect, read_lerobot
    >>> tmp = tempfile.TemporaryDirectory()
    >>> out = tmp.name + "/reach"
    >>> summary = collect("mock/reach", out, episodes=3)
    >>> summary["episodes"], summary["success_once"] > 0.5
    (3, True)
    >>> read_lerobot(out).num_episodes
    3
    >>> tmp.cleanup()
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from ebrl.demos.experts import expert_for
from ebrl.demos.features import ObsFeatures
from ebrl.demos.lerobot import LeRobotWriter
from ebrl.evaluation import _success, _task_names, _task_of, acting_mode
from ebrl.spaces import batch_of_one

DEMO_SEED = 1 << 29  # demonstration episode i starts from this seed + i (training and evaluation use others)


def collect(env_name: str, out: str | Path, *, episodes: int, policy: str | Path = "scripted",
            env_kwargs: dict[str, Any] | None = None, seed: int = DEMO_SEED, only_success: bool = False,
            image_format: str = "video", deterministic: bool = True, max_tries: int | None = None,
            fps: float | None = None) -> dict[str, Any]:
    """Write ``episodes`` episodes of ``env_name`` into a LeRobot dataset at ``out``.

    ``policy``: ``"scripted"`` (:func:`~ebrl.demos.experts.expert_for`) or the directory of an
    ``ebrl train`` run or ``ebrl sft`` output (its mode with ``deterministic``). ``only_success``
    keeps the episodes with a successful step, trying up to ``max_tries`` (default 4x) episodes.
    Returns a summary: episodes written, frames, episodes tried and their success rate.
    """
    from ebrl.envs import make

    env_kwargs = dict(env_kwargs or {})
    if episodes < 1:
        raise ValueError(f"episodes={episodes!r}: must be at least 1")
    if policy == "scripted" and env_name.startswith("maniskill/"):
        env_kwargs.setdefault("control_mode", "pd_ee_delta_pos")  # the experts drive the end effector
    if policy == "scripted" and env_name == "so101/PickCube":
        from ebrl.demos.so101_expert import EXPERT_ENV_KWARGS

        for key, value in EXPERT_ENV_KWARGS.items():  # the expert's top-down grasp; recorded with the dataset
            env_kwargs.setdefault(key, value)
    env = make(env_name, **env_kwargs)
    try:
        if policy == "scripted":
            expert = expert_for(env_name, env)
            act, model = (lambda obs: expert(obs)), None
        else:
            from ebrl.runs import load_run

            spec, trainer = load_run(policy)
            if spec["env"] != env_name:
                raise ValueError(f"{policy} was trained on {spec['env']}, not {env_name}")
            model = trainer.policy
            act = (lambda obs: model.act(batch_of_one(obs)).env_actions[0])
        feats = ObsFeatures(env.observation_space, image_format=image_format)
        action_shape = tuple(env.action_space.shape)
        rate = fps or float(env.metadata.get("render_fps") or 20)
        writer = LeRobotWriter(out, fps=rate, features={**feats.features(), "action": (action_shape, "float32")},
                               extra={"env": env_name, "env_kwargs": env_kwargs, "policy": str(policy),
                                      "seed": seed, "collected_by": "ebrl demos collect"})
        names = _task_names(env)
        tries, kept, successes = 0, 0, 0
        limit = max_tries if max_tries is not None else (4 * episodes if only_success else episodes)
        with acting_mode(model, deterministic and model is not None and hasattr(model, "deterministic")):
            while kept < episodes and tries < limit:
                obs, info = env.reset(seed=seed + tries)
                tries += 1
                task = _task_of(obs, info, names)
                rows, ok = [], False
                while True:
                    action = np.asarray(act(obs), np.float32).reshape(action_shape)
                    nxt, reward, terminated, truncated, info = env.step(action)
                    s = bool(_success(info))
                    ok = ok or s
                    rows.append({**feats.frame(obs), "action": action, "next.reward": float(reward),
                                 "next.done": bool(terminated or truncated), "next.success": s})
                    obs = nxt
                    if terminated or truncated:
                        break
                successes += ok
                if only_success and not ok:
                    continue
                for row in rows:
                    writer.add_frame(row, task=task)
                writer.end_episode()
                kept += 1
        if kept == 0:
            raise RuntimeError(f"no episode of {tries} succeeded: nothing written (the expert fails on {env_name}?)")
        writer.close()
    finally:
        env.close()
    return {"episodes": kept, "frames": writer.frames, "tried": tries,
            "success_once": successes / tries if tries else math.nan, "out": str(out)}
