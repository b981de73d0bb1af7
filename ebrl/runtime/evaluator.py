"""Evaluation during training (``run.eval_every_s``): the latest published weights, evaluated on
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
import threading
from pathlib import Path

import structlog

from ebrl.evaluation import evaluate, frame_source
from ebrl.policies.base import acting_copy, load_published
from ebrl.runtime.threads import in_thread

CLOSE_WAIT_S = 1.0  # at the run's end, an evaluation in progress gets this long to stop

log = structlog.get_logger("ebrl.eval")


async def evaluate_periodically(trainer, learner, stats, metrics, *, every_s: float, episodes: int,
                                log_dir: str | None) -> None:
    cfg = trainer.config
    stop = threading.Event()
    loop = asyncio.get_running_loop()
    policy = env = episode = None
    try:
        policy = acting_copy(trainer.policy)
        try:
            env = await in_thread(trainer.env_fn, cfg.num_envs, name="ebrl-eval", may_hang=True,
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
            episode = asyncio.ensure_future(in_thread(lambda: evaluate(
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
                await in_thread(env.close, name="ebrl-eval-close", may_hang=True, timeout_s=CLOSE_WAIT_S)
