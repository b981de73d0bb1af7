"""``run()``: build the pieces, run them under one TaskGroup, stop them cleanly.

Every task lives under the TaskGroup; the sim pool's threads or processes, the
generator's and learner's threads and the TensorBoard writer's thread are joined before
``run()`` returns or re-raises, also when the caller cancels it.

With ``RunConfig.log_dir`` set, the run's files go there: ``history.jsonl`` and the
TensorBoard event file, written after every update (:mod:`ebrl.telemetry.metrics`),
``result.json`` at the end and ``checkpoint.pt`` with ``checkpoint_every_s``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ebrl.algos.minibatch import MinibatchAlgo
from ebrl.algos.needs import resolve_run_config
from ebrl.config import DEFAULT_MAX_WAIT_S, ConfigError, LearnerMode, Offload, RunConfig, SegmentCut, SimBackend
from ebrl.distributed import DataParallel, combine_results, rank_config, reseed_sampling, weight_hash
from ebrl.envs.chunks import chunked_env_fn
from ebrl.evaluation import evaluate_periodically
from ebrl.policies.base import acting_copy
from ebrl.policies.expects import check_policy_spaces
from ebrl.runtime.children import helpers_scope
from ebrl.runtime.driver import Driver
from ebrl.runtime.env_facts import EnvFacts
from ebrl.runtime.errors import raise_first
from ebrl.runtime.fields import transition_fields
from ebrl.runtime.generation import Generator
from ebrl.runtime.learner import Checkpointing, InProcess, InThread, Learner, MetricRows, NonFiniteGuard
from ebrl.runtime.platform import Device, Platform, Threads, policy_device
from ebrl.runtime.probe import EnvProbe, StepProfile
from ebrl.runtime.resources.knobs import Decision
from ebrl.runtime.resources.manager import ResourceManager
from ebrl.runtime.resources.profiler import LiveProfiler
from ebrl.runtime.resources.rules_start import device_offload_start, learner_start, sim_start
from ebrl.runtime.rollout import RolloutQueue
from ebrl.runtime.schedules import effective_lag, generation_target, is_lockstep
from ebrl.runtime.state import RunState
from ebrl.runtime.stats import RunResult, RunStats, summarize
from ebrl.runtime.threads import in_thread
from ebrl.telemetry.logging import get_logger
from ebrl.telemetry.metrics import MetricsLog

if TYPE_CHECKING:
    from ebrl.telemetry.timeline import Timeline
    from ebrl.trainer import Trainer

log = get_logger("ebrl.run")

Progress = Callable[[RunStats, "Learner"], None]


async def run(trainer: Trainer, *, stop: asyncio.Event | None = None, progress: Progress | None = None,
              timeline: Timeline | None = None, platform: Platform | None = None) -> RunResult:
    """Train ``trainer`` on the running event loop until ``total_env_steps`` or ``stop`` is set.

    ``progress(stats, learner)`` is called every ``config.log_every_s`` seconds and at the end.
    ``timeline`` (:class:`ebrl.telemetry.timeline.Timeline`) records every env step, generation
    batch and update, in loop time. ``platform`` (:mod:`ebrl.runtime.platform`): what the run is
    built on; default this machine (:func:`ebrl.testing.run_virtual` passes virtual time's).
    """
    platform = platform or Platform()
    cfg = trainer.config
    called = asyncio.get_running_loop().time()  # start-up is timed from here (first_step_s, first_update_s)
    # under torchrun (WORLD_SIZE > 1) this run is one rank of a data-parallel job
    dp = DataParallel.from_env(timeout_s=cfg.faults.collective_timeout_s, device=policy_device(trainer.policy))
    clean = False
    try:
        if dp is not None:
            if not isinstance(trainer.algo, MinibatchAlgo):  # its minibatch loop is where the gradients meet
                raise ConfigError("algo", type(trainer.algo).__name__, "data-parallel training needs an algorithm "
                                  "derived from ebrl.algos.minibatch.MinibatchAlgo (PPO, DecoupledPPO, VTrace, GRPO)")
            cfg = rank_config(cfg, dp)
            dp.broadcast_module(trainer.policy)  # every rank starts from rank 0's weights
        with helpers_scope():  # the fork server and resource tracker this run starts end with it
            result = await _run(trainer, cfg, dp, platform, called, stop=stop, progress=progress,
                                timeline=timeline)
        clean = True
    finally:
        if dp is not None:
            dp.close(clean)
    return result


async def _run(trainer: Trainer, cfg: RunConfig, dp: DataParallel | None, platform: Platform, called: float, *,
               stop: asyncio.Event | None, progress: Progress | None, timeline: Timeline | None) -> RunResult:
    trainer, cfg, facts, step = await _inspect(trainer, cfg, platform)  # env 0, before any env steps
    device = platform.device(trainer.policy)
    start = start_decisions(cfg, step, device, platform.executor)
    parts = Parts(trainer, cfg, facts, start, device, platform, dp, timeline, called)
    loop = asyncio.get_running_loop()
    log.info("run_start", schedule=cfg.schedule.value, num_envs=cfg.num_envs, sim_backend=parts.pool.backend.value,
             sim_size=parts.pool.size, total_env_steps=cfg.total_env_steps, max_policy_lag=parts.rollout.max_lag)
    parts.learner.t0 = t0 = loop.time()
    wall0 = time.perf_counter()
    try:
        await parts.start(trainer, platform, start)
        async with asyncio.TaskGroup() as tg:
            helpers = [tg.create_task(parts.generator.serve(), name="ebrl-generator"),
                       tg.create_task(parts.manager.run(), name="ebrl-resources")]
            if progress is not None:
                helpers.append(tg.create_task(_report(progress, parts.stats, parts.learner, cfg.log_every_s)))
            if cfg.eval_every_s is not None:
                helpers.append(tg.create_task(evaluate_periodically(
                    trainer, parts.learner, parts.stats, parts.metrics, platform.executor, every_s=cfg.eval_every_s,
                    episodes=cfg.eval_episodes, log_dir=cfg.log_dir), name="ebrl-eval"))
            if stop is not None:
                helpers.append(tg.create_task(_watch_stop(stop, parts.state)))
            learn = tg.create_task(parts.learner.run(), name="ebrl-learner")
            drive = tg.create_task(parts.driver.run(), name="ebrl-driver")
            await learn
            for task in [drive] + helpers:  # a stop leaves envs parked on a queue that no one empties
                task.cancel()
        parts.manager.finish()  # before the pool closes: the last window reads its counters
    except BaseExceptionGroup as group:  # one error out of run(): the first, the others its notes
        raise_first(group)
    finally:
        parts.close()
    if progress is not None:
        progress(parts.stats, parts.learner)
    result = summarize(parts, t0, loop.time(), cpu_wall_s=time.perf_counter() - wall0)
    if dp is not None:  # every rank's counters, summed; the weights' hash of every rank
        result = combine_results(dp, result, weight_hash(trainer.policy))
    parts.metrics.write_result(result)
    log.info("run_end", env_steps=result.env_steps, steps_per_s=round(result.env_steps_per_s, 1),
             updates=result.updates, lag_max=result.lag_max, dropped=result.dropped,
             in_flight_at_stop=result.in_flight_at_stop, mean_return=result.mean_return)
    return result


async def _inspect(trainer: Trainer, cfg: RunConfig, platform: Platform
                   ) -> tuple[Trainer, RunConfig, EnvFacts, StepProfile | None]:
    """The trainer (its env built to execute a chunked policy's chunks), the config with the
    algorithm's needs resolved, env 0's facts and, under AUTO, its step's profile: env 0 is built
    once, in the probe (:mod:`~ebrl.runtime.probe`), and the trainer is checked against its
    spaces before any env steps anywhere, the probe's own timing steps included."""
    cfg = resolve_run_config(cfg, trainer.algo)  # a contradiction raises before any env is built
    env_fn = chunked_env_fn(trainer.env_fn, trainer.policy)  # a chunk policy on per-step envs
    if env_fn is not trainer.env_fn:
        trainer = dataclasses.replace(trainer, env_fn=env_fn)
    executor = platform.executor  # one without threads (virtual time) probes inline, on its own clocks
    async with EnvProbe(trainer.env_fn, cfg.sim, cfg.faults, where="auto" if executor.threads else "inline",
                        metered=executor.metered) as probe:
        facts = await probe.facts()
        cfg = resolve_run_config(cfg, trainer.algo, facts.max_episode_steps)
        check_policy_spaces(trainer.policy, facts.observation_space, facts.action_space)
        step = await probe.step_profile()
    inputs = getattr(trainer.policy, "describe_inputs", None)
    if callable(inputs):  # which observation entries the policy reads, and how
        log.info("policy_inputs", policy=type(trainer.policy).__name__, inputs=inputs())
    return trainer, cfg, facts, step


class Parts:
    """The runtime of one run: what ``run()`` starts, runs under its TaskGroup, closes, and reads
    its result from; built for ``trainer`` and its ``cfg`` on ``platform``."""

    def __init__(self, trainer: Trainer, cfg: RunConfig, facts: EnvFacts, start: list[Decision], device: Device,
                 platform: Platform, dp: DataParallel | None, timeline: Timeline | None, called: float):
        self.cfg, self.device, self.timeline = cfg, device, timeline
        self.manager: ResourceManager | None = None  # made at start(), once the pool runs
        self.old_threads = torch.get_num_threads()  # restored at close()
        chosen = {d.knob: d.new for d in start}
        self.mode = mode = LearnerMode(chosen.get("learner", cfg.learner))
        if device.in_process_only and mode is LearnerMode.PROCESS:
            raise ConfigError("learner", cfg.learner.value, f"a policy on {device.name} trains in a thread of this "
                              "process, beside the generator on the same device: set learner='auto' or 'thread'")
        self.stats = stats = RunStats(started_at=called)
        self.state = state = RunState(budget=cfg.total_env_steps, active=cfg.num_envs)
        # AUTO's choice is a start: the controller may move envs between lanes and workers
        movable = cfg.sim.backend is SimBackend.AUTO and cfg.resources.adapt
        self.pool = platform.sim_pool(trainer.env_fn, cfg.num_envs, cfg.sim,
                                      backend=chosen.get("backend", cfg.sim.backend), lanes=chosen.get("lanes"),
                                      movable=movable, spaces=(facts.observation_space, facts.action_space),
                                      build_timeout_s=cfg.faults.build_timeout_s)
        self.rollout = rollout = RolloutQueue(
            cfg.num_envs, cfg.segment_len, cfg.segments_per_batch, effective_lag(cfg), stats,
            transition_fields(facts.observation_space, facts.action_space), is_lockstep(cfg.schedule), state,
            cut_at_episode_end=cfg.segment_cut is SegmentCut.EPISODE, stream=cfg.segment_cut is SegmentCut.STREAM)
        # GpuStreams, an emulated device's streams, or None
        self.streams = streams = device.streams(cfg.resources.gpu_streams) if mode is LearnerMode.THREAD else None
        if streams is not None:
            log.info("gpu_streams", **streams.describe())
        acting = acting_copy(trainer.policy)  # shares a frozen backbone where the policy has one
        if dp is not None:  # the ranks' weights are one, their exploration noise is not
            reseed_sampling(acting, cfg.seed)
        self.generator = Generator(acting, batch_target=generation_target(cfg),
                                   max_wait_s=_or(cfg.generation.max_wait_s, DEFAULT_MAX_WAIT_S), state=state,
                                   offload=Offload(chosen.get("offload", cfg.generation.offload)),
                                   on_batch=rollout.mark_inflight, timeline=timeline, streams=streams,
                                   stage=platform.executor.stage("generator", trainer.policy))
        # log_dir None: rows stay in memory (RunResult.history), nothing is written
        self.metrics = MetricsLog(cfg.log_dir, wandb={"project": cfg.wandb_project, "config": cfg.to_dict()}
                                  if cfg.wandb else None)
        hooks = [NonFiniteGuard(cfg.faults.nonfinite), MetricRows(self.metrics)]
        if cfg.log_dir is not None:  # periodic checkpoints if asked for; always one if the learner process dies
            hooks.append(Checkpointing(Path(cfg.log_dir) / "checkpoint.pt", _or(cfg.checkpoint_every_s, math.inf),
                                       type(trainer.policy).__name__, trainer.env_steps_done))
        stage = platform.executor.stage("learner", trainer.algo)
        worker = InThread(trainer.policy, trainer.algo, streams=streams, dp=dp,
                          timeout_s=cfg.faults.update_timeout_s, clock=stage.now)
        self.learner = Learner(worker, rollout, self.generator, stats, state, stage=stage, hooks=hooks, dp=dp,
                               timeline=timeline)
        self.driver = Driver(cfg, self.pool, self.generator, rollout, stats, state, timeline)

    async def start(self, trainer: Trainer, platform: Platform, start: list[Decision]) -> None:
        """The learner process (if any), the sim pool, the metric files and the controller."""
        cfg, threads = self.cfg, self.cfg.resources.learner_threads or self.cfg.torch_threads
        if cfg.torch_threads is not None:
            torch.set_num_threads(cfg.torch_threads)
        if self.mode is LearnerMode.PROCESS:
            def start_learner() -> None:  # set by the thread: a cancel while it forks still closes it
                self.learner.worker = InProcess(trainer.policy, trainer.algo, threads, cfg.sim.start_method,
                                                start_timeout_s=cfg.faults.build_timeout_s,
                                                update_timeout_s=cfg.faults.update_timeout_s)

            # forking copies this process's page tables (~8 ms with torch loaded): off the loop
            await in_thread(start_learner, name="ebrl-learner-start")
        await self.pool.start()
        # after the forks above (learner process, sim workers): the writer's thread must not be forked
        self.metrics.open()
        nvml = self.device.nvml()  # cores, and GPUs via pynvml (an emulated device's own)
        self.metrics.system = platform.sampler(nvml)
        profiler = LiveProfiler(self.pool, self.driver, self.generator, self.learner, asyncio.get_running_loop().time,
                                system=platform.sampler(nvml))
        self.manager = ResourceManager(cfg, profiler, self.pool, self.driver, self.generator, platform.executor.cpus(),
                                       self.streams, self.learner, learner_threads=threads, start=start)

    def close(self) -> None:
        """Every thread, process and file of the run, whatever state it is in."""
        try:
            self.pool.close()
            self.learner.close()  # with a learner process, this loads the trained state into the trainer's copies
        finally:
            self.metrics.close()  # flushes the files and joins the TensorBoard writer's thread
            if self.manager is not None:
                self.manager.close()
            torch.set_num_threads(self.old_threads)


def _or(value, default):
    return default if value is None else value


def start_decisions(cfg: RunConfig, step: StepProfile | None, device: Device, executor: Threads) -> list[Decision]:
    """The controller's decisions before the first epoch (:mod:`~ebrl.runtime.resources.rules_start`):
    AUTO's backend and lanes from the probe's ``step``, AUTO's learner mode, and where a device
    policy's calls run, for the cores and processes the platform's ``executor`` offers."""
    cpus, processes = executor.cpus(), executor.processes
    decisions = [] if step is None else sim_start(step, cfg.sim, cfg.num_envs, cpus, processes)
    if cfg.learner is LearnerMode.AUTO:
        decisions.append(learner_start(device.name, cpus, processes))
    if cfg.generation.offload is Offload.AUTO and device.name not in (None, "cpu"):
        decisions.append(device_offload_start(device.name))
    return decisions


async def _watch_stop(stop: asyncio.Event, state: RunState) -> None:
    await stop.wait()
    log.info("stop_requested")
    state.stop()  # a learner waiting for data wakes (the rollout watches the state) and ends after its update


async def _report(progress: Progress, stats: RunStats, learner: Learner, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        progress(stats, learner)


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where uvloop is installed, else None (asyncio's own)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run_sync(trainer: Trainer, *, platform: Platform | None = None, **kwargs) -> RunResult:
    """Run on a fresh event loop: the platform's (virtual time's), else uvloop's where installed,
    else asyncio's own."""
    factory = platform.loop_factory if platform is not None and platform.loop_factory is not None else loop_factory()
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(run(trainer, platform=platform, **kwargs))
