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

from ebrl.algos.needs import resolve_run_config
from ebrl.algos.minibatch import MinibatchAlgo
from ebrl.config import (DEFAULT_MAX_WAIT_S, ConfigError, LearnerMode, Offload, RunConfig, SegmentCut, SimBackend,
                         StreamMode)
from ebrl.distributed import DataParallel, combine_results, rank_config, reseed_sampling, weight_hash
from ebrl.emulated import EmulatedStreams, emulator_of
from ebrl.envs.chunks import chunked_env_fn
from ebrl.policies.base import acting_copy
from ebrl.policies.expects import check_policy_spaces
from ebrl.runtime.children import helpers_scope
from ebrl.runtime.driver import Driver
from ebrl.runtime.env_facts import EnvFacts, inspect_env
from ebrl.runtime.errors import raise_first
from ebrl.runtime.fields import transition_fields
from ebrl.runtime.generation import Generator
from ebrl.runtime.learner import Checkpointing, Learner
from ebrl.runtime.learner_process import LearnerProcess
from ebrl.runtime.resources.gpu import GpuStreams
from ebrl.runtime.resources.knobs import Decision
from ebrl.runtime.resources.manager import ResourceManager
from ebrl.runtime.resources.profiler import LiveProfiler
from ebrl.runtime.resources.rules_start import device_offload_start, learner_start, sim_start
from ebrl.runtime.rollout import RolloutQueue
from ebrl.runtime.schedules import effective_lag, generation_target, is_lockstep
from ebrl.runtime.probe import EnvProbe, StepProfile
from ebrl.runtime.sim import SimPool
from ebrl.runtime.state import RunState
from ebrl.runtime.stats import RunResult, RunStats, summarize
from ebrl.runtime.threads import in_thread, usable_cpus
from ebrl.runtime.virtual_time import is_virtual
from ebrl.telemetry.logging import get_logger
from ebrl.telemetry.metrics import MetricsLog
from ebrl.telemetry.system import SystemSampler

if TYPE_CHECKING:
    from ebrl.telemetry.timeline import Timeline
    from ebrl.trainer import Trainer

log = get_logger("ebrl.run")

Progress = Callable[[RunStats, "Learner"], None]


async def run(trainer: "Trainer", *, stop: asyncio.Event | None = None,
              progress: Progress | None = None, timeline: "Timeline | None" = None) -> RunResult:
    """Train ``trainer`` on the running event loop until ``total_env_steps`` or ``stop`` is set.

    ``progress(stats, learner)`` is called every ``config.log_every_s`` seconds and at the end.
    ``timeline`` (:class:`ebrl.telemetry.timeline.Timeline`) records every env step, generation
    batch and update, in loop time.
    """
    cfg = trainer.config
    loop = asyncio.get_running_loop()
    called = loop.time()  # start-up is timed from here (RunResult.first_step_s, first_update_s)
    virtual = is_virtual(loop)
    # under torchrun (WORLD_SIZE > 1) this run is one rank of a data-parallel job
    dp = None if virtual else DataParallel.from_env(timeout_s=cfg.faults.collective_timeout_s,
                                                    device=policy_device(trainer.policy))
    clean = False
    try:
        if dp is not None:
            if not isinstance(trainer.algo, MinibatchAlgo):  # its minibatch loop is where the gradients meet
                raise ConfigError("algo", type(trainer.algo).__name__, "data-parallel training needs an algorithm "
                                  "derived from ebrl.algos.minibatch.MinibatchAlgo (PPO, DecoupledPPO, VTrace, GRPO)")
            cfg = rank_config(cfg, dp)
            dp.broadcast_module(trainer.policy)  # every rank starts from rank 0's weights
        with helpers_scope():  # the fork server and resource tracker this run starts end with it
            result = await _run(trainer, cfg, dp, loop, virtual, called, stop=stop, progress=progress,
                                timeline=timeline)
        clean = True
    finally:
        if dp is not None:
            dp.close(clean)
    return result


async def _run(trainer: "Trainer", cfg: RunConfig, dp: DataParallel | None, loop, virtual: bool, called: float, *,
               stop: asyncio.Event | None, progress: Progress | None, timeline: "Timeline | None") -> RunResult:
    # the algorithm's needs fill the config's auto fields; a contradiction raises before any env is built
    cfg = resolve_run_config(cfg, trainer.algo)
    # a policy acting in chunks of K on envs that take one action: each env runs the chunk itself
    env_fn = chunked_env_fn(trainer.env_fn, trainer.policy)
    if env_fn is not trainer.env_fn:
        trainer = dataclasses.replace(trainer, env_fn=env_fn)
    # env 0 once, for its spaces and time limit, built in the probe's child process (virtual time:
    # inline). The trainer is checked against them before any env steps anywhere, the probe's
    # own timing steps (AUTO) included: one error naming both spaces
    step = None
    if virtual:
        facts = inspect_env(trainer.env_fn)
        cfg = _checked(trainer, cfg, facts)
    else:
        async with EnvProbe(trainer.env_fn, cfg.sim, cfg.faults) as probe:
            facts = await probe.facts()
            cfg = _checked(trainer, cfg, facts)
            step = await probe.step_profile()
    inputs = getattr(trainer.policy, "describe_inputs", None)
    if callable(inputs):  # which observation entries the policy reads, and how
        log.info("policy_inputs", policy=type(trainer.policy).__name__, inputs=inputs())
    # the controller's first decisions resolve the config's auto values (rules_start.py)
    start = start_decisions(cfg, step, trainer.policy, virtual)
    chosen = {d.knob: d.new for d in start}
    backend = SimBackend(chosen.get("backend", SimBackend.INLINE if virtual else cfg.sim.backend))
    mode = LearnerMode(chosen.get("learner", LearnerMode.THREAD if virtual else cfg.learner))
    emulator = emulator_of(trainer.policy)
    if emulator is not None and mode is LearnerMode.PROCESS:
        raise ConfigError("learner", cfg.learner.value, "a policy on an emulated device trains in a thread of this "
                          "process, beside the generator on the same device: set learner='auto' or 'thread'")
    old_threads = torch.get_num_threads()
    if cfg.torch_threads is not None:
        torch.set_num_threads(cfg.torch_threads)
    stats = RunStats(started_at=called)
    state = RunState(budget=cfg.total_env_steps, active=cfg.num_envs)
    # AUTO's choice is a start: the controller may move envs between lanes and workers
    movable = cfg.sim.backend is SimBackend.AUTO and cfg.resources.adapt and not virtual
    pool = SimPool(trainer.env_fn, cfg.num_envs, cfg.sim, backend=backend, lanes=chosen.get("lanes"), movable=movable,
                   spaces=(facts.observation_space, facts.action_space), build_timeout_s=cfg.faults.build_timeout_s)
    lockstep, lag = is_lockstep(cfg.schedule), effective_lag(cfg)
    rollout = RolloutQueue(cfg.num_envs, cfg.segment_len, cfg.segments_per_batch, lag, stats,
                           transition_fields(facts.observation_space, facts.action_space), lockstep,
                           state, cut_at_episode_end=cfg.segment_cut is SegmentCut.EPISODE)
    learner_threads = cfg.resources.learner_threads or cfg.torch_threads  # the learner process's
    streams = (gpu_streams(trainer.policy, cfg.resources.gpu_streams) if mode is LearnerMode.THREAD and not virtual
               else None)
    acting = acting_copy(trainer.policy)  # shares a frozen backbone where the policy has one
    if dp is not None:  # the ranks' weights are one, their exploration noise is not
        reseed_sampling(acting, cfg.seed)
    generator = Generator(acting, batch_target=generation_target(cfg),
                          max_wait_s=_or(cfg.generation.max_wait_s, DEFAULT_MAX_WAIT_S), state=state,
                          offload=Offload(chosen.get("offload", cfg.generation.offload)),
                          on_batch=rollout.mark_inflight, timeline=timeline, streams=streams)
    checkpoint = None
    if cfg.log_dir is not None:  # periodic checkpoints if asked for; always one if the learner process dies
        checkpoint = Checkpointing(Path(cfg.log_dir) / "checkpoint.pt", _or(cfg.checkpoint_every_s, math.inf),
                                   type(trainer.policy).__name__, trainer.env_steps_done)
    # log_dir None: rows stay in memory (RunResult.history), nothing is written
    metrics = MetricsLog(cfg.log_dir, wandb={"project": cfg.wandb_project, "config": cfg.to_dict()}
                         if cfg.wandb else None)
    learner = Learner(trainer.policy, trainer.algo, rollout, generator, stats, state,
                      pause_generation=lockstep or lag == 0, timeline=timeline, checkpoint=checkpoint,
                      metrics=metrics, streams=streams, nonfinite=cfg.faults.nonfinite, dp=dp,
                      update_timeout_s=cfg.faults.update_timeout_s)
    driver = Driver(cfg, pool, generator, rollout, stats, state, timeline)
    manager: ResourceManager | None = None
    log.info("run_start", schedule=cfg.schedule.value, num_envs=cfg.num_envs, sim_backend=pool.backend.value,
             sim_size=pool.size, total_env_steps=cfg.total_env_steps, max_policy_lag=lag, virtual_time=virtual)
    t0, wall0 = loop.time(), time.perf_counter()
    learner.t0 = t0
    try:
        if mode is LearnerMode.PROCESS:
            def start_learner() -> None:  # set by the thread: a cancel while it forks still closes it
                learner.remote = LearnerProcess(trainer.policy, trainer.algo, learner_threads, cfg.sim.start_method,
                                                start_timeout_s=cfg.faults.build_timeout_s,
                                                update_timeout_s=cfg.faults.update_timeout_s)

            # forking copies this process's page tables (~8 ms with torch loaded): off the loop
            await in_thread(start_learner, name="ebrl-learner-start")
        await pool.start()
        # after the forks above (learner process, sim workers): the writer's thread must not be forked
        metrics.open()
        # cores, and GPUs via pynvml (an emulated device answers as one)
        gpus = (lambda: None) if emulator is None else emulator.nvml
        if not virtual:  # a virtual run's hardware use means nothing, and its history stays deterministic
            metrics.system = SystemSampler(nvml=gpus())
        profiler = LiveProfiler(pool, driver, generator, learner, loop.time,
                                system=None if virtual else SystemSampler(nvml=gpus()))
        manager = ResourceManager(cfg, profiler, pool, driver, generator, virtual, streams, learner,
                                  learner_threads=learner_threads, start=start)
        async with asyncio.TaskGroup() as tg:
            helpers = [tg.create_task(generator.serve(), name="ebrl-generator"),
                       tg.create_task(manager.run(), name="ebrl-resources")]
            if progress is not None:
                helpers.append(tg.create_task(_report(progress, stats, learner, cfg.log_every_s)))
            if cfg.eval_every_s is not None and not virtual:
                from ebrl.evaluation import evaluate_periodically

                helpers.append(tg.create_task(evaluate_periodically(
                    trainer, learner, stats, metrics, every_s=cfg.eval_every_s, episodes=cfg.eval_episodes,
                    log_dir=cfg.log_dir), name="ebrl-eval"))
            if stop is not None:
                helpers.append(tg.create_task(_watch_stop(stop, state)))
            learn = tg.create_task(learner.run(), name="ebrl-learner")
            drive = tg.create_task(driver.run(), name="ebrl-driver")
            await learn
            for task in [drive] + helpers:  # a stop leaves envs parked on a queue that no one empties
                task.cancel()
        manager.finish()  # before the pool closes: the last window reads its counters
    except BaseExceptionGroup as group:  # one error out of run(): the first, the others its notes
        raise_first(group)
    finally:
        try:
            pool.close()
            learner.close()  # with a learner process, this loads the trained state into trainer.policy/algo
        finally:
            metrics.close()  # flushes the files and joins the TensorBoard writer's thread
            if manager is not None:
                manager.close()
            torch.set_num_threads(old_threads)
    if progress is not None:
        progress(stats, learner)
    t_end = loop.time()
    wall_s, versions = t_end - t0, learner.version
    busy = {}
    if wall_s > 0:
        busy = {"generator": generator.busy_s / wall_s, "learner": learner.busy_s / wall_s}
        if timeline is not None:
            busy["sim"] = timeline.busy_fraction("env", t0, t_end, name="sim")
    result = summarize(
        stats, schedule=cfg.schedule.value, wall_s=wall_s, in_flight=rollout.pending_steps() + learner.untrained_in_hand,
        version=versions, gen_batches=generator.batch_sizes, ended_at=t_end,
        steps_per_env=rollout.steps_per_env.tolist(), history=learner.history,
        gen_wait_max_s=generator.max_request_wait_s, gen_costs=generator.costs.to_dict(),
        timeouts=driver.recovery.timeouts, respawns=pool.respawns, migrations=driver.moves.done,
        sim_backend=pool.backend.value, sim_size=pool.size, learner_mode=mode.value,
        generator_busy_s=generator.busy_s, learner_busy_s=learner.busy_s, busy=busy,
        cpu_wall_s=time.perf_counter() - wall0,
        profiles=[p.to_dict() for p in manager.profiles], decisions=[d.to_dict() for d in manager.decisions],
        evaluations=list(metrics.eval_rows),
        publications=versions,
        publish_bytes=stats.published_bytes / versions if versions else math.nan,
        publish_s=(stats.publish_snapshot_s + generator.load_weights_s) / versions if versions else math.nan)
    if dp is not None:  # every rank's counters, summed; the weights' hash of every rank
        result = combine_results(dp, result, weight_hash(trainer.policy))
    metrics.write_result(result)
    log.info("run_end", env_steps=result.env_steps, steps_per_s=round(result.env_steps_per_s, 1),
             updates=result.updates, lag_max=result.lag_max, dropped=result.dropped,
             in_flight_at_stop=result.in_flight_at_stop, mean_return=result.mean_return)
    return result


def _checked(trainer: "Trainer", cfg: RunConfig, facts: EnvFacts) -> RunConfig:
    """``cfg`` with the algorithm's needs resolved against env 0's time limit (whole episodes:
    segment_len), after the policy is checked against env 0's spaces."""
    cfg = resolve_run_config(cfg, trainer.algo, facts.max_episode_steps)
    check_policy_spaces(trainer.policy, facts.observation_space, facts.action_space)
    return cfg


def policy_device(policy) -> torch.device | None:
    """The device of a torch policy's first parameter; None for a policy without parameters."""
    params = getattr(policy, "parameters", None)
    first = next(iter(params()), None) if callable(params) else None
    return None if first is None else first.device


def gpu_streams(policy, mode: StreamMode) -> GpuStreams | None:
    """Generation and training streams in ``mode`` (or the richest mode below it that works)
    for a policy on a CUDA device or an emulated one; None for one on the CPU."""
    emulator = emulator_of(policy)
    if emulator is not None:
        streams = EmulatedStreams.of(emulator, mode)
        log.info("gpu_streams", **streams.describe())
        return streams
    device = policy_device(policy)
    if device is None or device.type != "cuda":
        return None
    streams = GpuStreams.create(device=device, max_mode=mode)
    log.info("gpu_streams", **streams.describe())
    return streams


def _or(value, default):
    return default if value is None else value


def start_decisions(cfg: RunConfig, step: StepProfile | None, policy, virtual: bool) -> list[Decision]:
    """The controller's decisions before the first epoch (:mod:`~ebrl.runtime.resources.rules_start`):
    AUTO's backend and lanes from the probe's ``step``, and AUTO's learner mode. A virtual run
    makes none: it steps inline and trains in a thread."""
    decisions = [] if step is None else sim_start(step, cfg.sim, cfg.num_envs, usable_cpus())
    emulator = emulator_of(policy)
    device = policy_device(policy)
    where = (f"the emulated device {emulator.profile.name}" if emulator is not None
             else None if device is None else device.type)
    if cfg.learner is LearnerMode.AUTO and not virtual:
        decisions.append(learner_start(where, usable_cpus()))
    if cfg.generation.offload is Offload.AUTO and not virtual and where not in (None, "cpu"):
        decisions.append(device_offload_start(where))
    return decisions


async def _watch_stop(stop: asyncio.Event, state: RunState) -> None:
    await stop.wait()
    log.info("stop_requested")
    state.stop()  # a learner waiting for data wakes (the rollout watches the state), and ends after the update in flight


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


def run_sync(trainer: "Trainer", **kwargs) -> RunResult:
    """Run on a fresh uvloop event loop (asyncio's own where uvloop is not installed)."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(run(trainer, **kwargs))
