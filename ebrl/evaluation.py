"""Evaluating a policy: fixed seeds, success with its interval, per task, and a video.

The protocol, printed with every result (``EvalResult.protocol``): episode ``i`` starts from
``env.reset(seed=EVAL_SEED + i)`` (training seeds are the run's ``seed`` plus an env's index,
far below), in one env, one episode after another, each to its end (terminated or truncated by
the env's own time limit); actions are the policy's samples, or with ``deterministic`` its
mode (the Gaussian's mean, the likeliest token, the flow from zero noise); a step succeeds when
its ``info`` says ``success`` or ``is_success``. ``success_once``: the share of episodes with a
successful step; ``success_at_end``: the share whose last step succeeded; each with a 95%
Wilson interval. Returns are the env's rewards, undiscounted.

    >>> from ebrl.evaluation import evaluate
    >>> from ebrl.testing import InstructedReach, MockPolicy
    >>> r = evaluate(MockPolicy(act_dim=2), InstructedReach(tasks=2), episodes=4)
    >>> r.episodes, r.mean_length, sorted(r.per_task)
    (4, 32.0, ['reach the green target', 'reach the red target'])

During training (``run.eval_every_s``, :func:`evaluate_periodically`): the latest published weights, evaluated on
an env of its own, in a thread, while rollout goes on.

Every ``eval_every_s`` seconds the evaluator loads the weights the generator acts with (the
last publication) into its own copy of the policy (sharing a frozen backbone) and runs
``eval_episodes`` episodes with :func:`ebrl.evaluation.evaluate` (fixed evaluation seeds, the
policy's mode) on env ``num_envs`` (built by the trainer's ``env_fn``, beside the training
envs). Nothing pauses: the episodes run in a thread of their own, and the run's envs keep
stepping. The result becomes one row of ``eval.jsonl`` (and of ``RunResult.evaluations``) and
``eval/*`` scalars at the env steps and run time the weights had reached; with a log directory and an env that renders (or a camera in its
observation) the first episode is also written to ``eval/steps-<N>.mp4`` and shown in
TensorBoard's images as ``eval/video`` (an animated GIF).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from ebrl.envs.chunks import for_policy
from ebrl.policies.base import acting_copy, load_published
from ebrl.runtime.threads import CLOSE_WAIT_S, in_thread
from ebrl.spaces import batch_of_one

EVAL_SEED = 1 << 30  # evaluation episode i starts from this seed + i


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a success rate (sound at 0 and 1, unlike p +- 2 se).

        >>> [round(x, 3) for x in wilson(0, 10)], [round(x, 3) for x in wilson(5, 10)]
        ([0.0, 0.278], [0.237, 0.763])
    """
    if n == 0:
        return math.nan, math.nan
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass
class EvalResult:
    episodes: int
    success_once: float
    success_once_ci: tuple[float, float]
    success_at_end: float
    success_at_end_ci: tuple[float, float]
    mean_return: float
    std_return: float
    mean_length: float
    per_task: dict[str, dict[str, float]] = field(default_factory=dict)
    seeds: tuple[int, int] = (EVAL_SEED, EVAL_SEED)  # first and last
    deterministic: bool = False
    video: str | None = None
    returns: list[float] = field(default_factory=list)
    frames: list = field(default_factory=list, repr=False)  # the video's frames (uint8 [H, W, 3]), not saved

    @property
    def protocol(self) -> str:
        return (f"{self.episodes} episodes from seeds {self.seeds[0]}..{self.seeds[1]} (ebrl.evaluation.EVAL_SEED + i), "
                f"one env, each to its end; actions {'the mode' if self.deterministic else 'sampled'}; success from "
                f"info['success'] or info['is_success']; intervals 95% Wilson")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["frames"]
        out["protocol"] = self.protocol
        return out


@contextmanager
def acting_mode(policy, deterministic: bool):
    """``policy.deterministic`` set for the block (policies that have the attribute act with their mode)."""
    if not deterministic:
        yield
        return
    if not hasattr(policy, "deterministic"):
        raise ValueError(f"{type(policy).__name__} has no deterministic mode (no 'deterministic' attribute)")
    before = policy.deterministic
    policy.deterministic = True
    try:
        yield
    finally:
        policy.deterministic = before


def _success(info: dict) -> bool | None:
    for key in ("success", "is_success"):
        if key in info:
            return bool(np.asarray(info[key]).reshape(-1)[0])
    return None


def _task_names(env) -> list[str] | None:
    try:
        return list(env.get_wrapper_attr("instructions")())
    except AttributeError:
        return None


def _task_of(obs: Any, info: dict, names: list[str] | None) -> str:
    if isinstance(obs, dict) and "instruction" in obs and names:
        return names[int(np.asarray(obs["instruction"]).reshape(-1)[0])]
    for key in ("instruction", "task"):
        if isinstance(info.get(key), str):
            return info[key]
    return names[0] if names and len(names) == 1 else ""


def frame_source(env):
    """``frame(obs) -> uint8 [H, W, 3]`` for a video of ``env``: its render in ``rgb_array`` mode,
    else its observation's first camera (channels last); None when it has neither."""
    if getattr(env, "render_mode", None) == "rgb_array":
        return lambda obs: np.asarray(env.render(), np.uint8)
    from ebrl.demos.features import ObsFeatures

    try:
        feats = ObsFeatures(env.observation_space)
    except ValueError:
        return None
    cameras = [name for _, name, _ in feats.entries if name.startswith("observation.image")]
    if not cameras:
        return None

    def frame(obs: Any) -> np.ndarray:
        img = np.asarray(feats.frame(obs)[cameras[0]], np.uint8)
        return np.repeat(img, 3, -1) if img.shape[-1] == 1 else img

    return frame


def write_video(frames: list[np.ndarray], path: str | Path, fps: float = 20.0) -> Path:
    """MP4 (H.264 through imageio-ffmpeg); a GIF next to it when no ffmpeg works. Returns the file written."""
    import imageio.v2 as imageio

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() != ".gif":
        try:
            with imageio.get_writer(path, fps=fps, codec="libx264", pixelformat="yuv420p", macro_block_size=1) as w:
                for f in frames:
                    w.append_data(f)
            return path
        except Exception:  # no ffmpeg binary, or a codec it lacks: the GIF needs only pillow
            path.unlink(missing_ok=True)
            path = path.with_suffix(".gif")
    imageio.mimsave(path, frames, duration=1000.0 / fps, loop=0)
    return path


def evaluate(policy, env, *, episodes: int = 10, seed: int = EVAL_SEED, deterministic: bool = False,
             video: str | Path | None = None, video_episodes: int = 1, fps: float = 20.0,
             stop: Any = None) -> EvalResult:
    """Run ``episodes`` episodes of ``policy`` (``act(batch) -> ActResult``) in ``env``; see the module docstring.

    ``video``: a path for an MP4 of the first ``video_episodes`` episodes (frames from
    ``env.render()`` in ``rgb_array`` mode, else the observation's first camera). ``stop``: a
    ``threading.Event`` that, once set, ends the evaluation at the next step (``InterruptedError``).
    """
    if episodes < 1:
        raise ValueError(f"episodes={episodes!r}: must be at least 1")
    env = for_policy(env, policy)  # a chunking policy's K actions run per decision
    frame = frame_source(env) if video is not None else None
    if video is not None and frame is None:  # said before any episode runs
        raise ValueError("--video: the env renders no frames (make it with render_mode='rgb_array' or pixels=)")
    names = _task_names(env)
    once, at_end, returns, lengths, tasks = [], [], [], [], []
    frames: list[np.ndarray] = []
    with acting_mode(policy, deterministic):
        for i in range(episodes):
            obs, info = env.reset(seed=seed + i)
            task = _task_of(obs, info, names)
            ret, length, ok, last = 0.0, 0, False, False
            filming = video is not None and i < video_episodes
            while True:
                if stop is not None and stop.is_set():
                    raise InterruptedError("evaluation stopped")
                if filming:
                    frames.append(frame(obs))
                result = policy.act(batch_of_one(obs))
                obs, reward, terminated, truncated, info = env.step(result.env_actions[0])
                ret += float(reward)
                length += 1
                s = _success(info)
                last = bool(s)
                ok = ok or last
                if terminated or truncated:
                    break
            if filming:
                frames.append(frame(obs))
            once.append(ok)
            at_end.append(last)
            returns.append(ret)
            lengths.append(length)
            tasks.append(task)
    written = None
    if video is not None:
        written = str(write_video(frames, video, fps))
    per_task = {}
    for name in sorted(set(tasks)):
        idx = [j for j, t in enumerate(tasks) if t == name]
        per_task[name or "(one task)"] = {"episodes": len(idx), "success_once": float(np.mean([once[j] for j in idx])),
                                          "success_at_end": float(np.mean([at_end[j] for j in idx])),
                                          "mean_return": float(np.mean([returns[j] for j in idx]))}
    n = len(once)
    return EvalResult(episodes=n, success_once=float(np.mean(once)), success_once_ci=wilson(sum(once), n),
                      success_at_end=float(np.mean(at_end)), success_at_end_ci=wilson(sum(at_end), n),
                      mean_return=float(np.mean(returns)), std_return=float(np.std(returns)),
                      mean_length=float(np.mean(lengths)), per_task=per_task, seeds=(seed, seed + n - 1),
                      deterministic=deterministic, video=written, returns=returns, frames=frames)


log = structlog.get_logger("ebrl.eval")


async def evaluate_periodically(trainer, learner, stats, metrics, executor=None, *, every_s: float, episodes: int,
                                log_dir: str | None) -> None:
    cfg = trainer.config
    offload = executor.call if executor is not None else in_thread  # the platform's (inline under virtual time)
    stop = threading.Event()
    loop = asyncio.get_running_loop()
    policy = env = episode = None
    try:
        policy = acting_copy(trainer.policy)
        try:
            env = await offload(trainer.env_fn, cfg.num_envs, name="ebrl-eval", may_hang=True,
                                timeout_s=cfg.faults.build_timeout_s)
        except TimeoutError:  # training goes on; the evaluations do not
            log.error("eval_env_build_timed_out", env=cfg.num_envs, limit_s=cfg.faults.build_timeout_s)
            return
        filmed = log_dir is not None and frame_source(env) is not None  # an env without frames: no video
        deterministic = hasattr(policy, "deterministic")
        while True:
            await asyncio.sleep(every_s)
            version, steps, at = learner.version, stats.simulated, loop.time() - learner.t0
            load_published(policy, learner.published())
            video = Path(log_dir) / "eval" / f"steps-{steps}.mp4" if filmed else None
            # a task of its own, shielded: a cancel leaves it running, and the finally below gives it
            # the time to see ``stop`` before the env is closed under it
            episode = asyncio.ensure_future(offload(lambda: evaluate(
                policy, env, episodes=episodes, deterministic=deterministic, video=video, stop=stop),
                name="ebrl-eval", may_hang=True))
            result = await asyncio.shield(episode)
            row = {"env_steps": steps, "time": round(at, 3), "policy_version": version, "episodes": result.episodes,
                   "success_once": result.success_once, "success_at_end": result.success_at_end,
                   "mean_return": result.mean_return, "mean_length": result.mean_length}
            metrics.record_eval(row, video=result.video)
            metrics.record_video("eval/video", result.frames, steps)
            log.info("eval", **row, video=result.video)
    finally:
        stop.set()  # an episode in progress ends at its next step
        if episode is not None and not episode.done():
            await asyncio.wait([episode], timeout=CLOSE_WAIT_S)
        if episode is not None and not episode.done():  # hung in a step or a render: the env stays its thread's
            episode.cancel()
            log.warning("eval_left_running", wait_s=CLOSE_WAIT_S, hint="an evaluation step or render never returned")
        elif env is not None:
            with contextlib.suppress(TimeoutError):
                await offload(env.close, name="ebrl-eval-close", may_hang=True, timeout_s=CLOSE_WAIT_S)
