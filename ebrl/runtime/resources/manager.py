"""ResourceManager: every epoch, a profile, the controller's decisions, and the actuators.

A task under the run's TaskGroup. Every ``resources.epoch_s`` (loop time), once the window
holds ``MIN_STEPS_PER_UNIT`` env steps per env (or has lasted ``MAX_WINDOW_EPOCHS`` epochs, or
training held the envs back for most of it), it takes an
:class:`~ebrl.runtime.resources.profiler.EpochProfile`, asks
:func:`~ebrl.runtime.resources.controller.decide` (unless ``resources.adapt`` is false) and
applies each decision through its knob's actuator: the sim pool (lanes, workers, where each env
runs: envs move at their episode ends, workers start off the loop and retire once empty), the
generator, the GPU streams, the learner process's threads and core affinity. It also holds the
start decisions (``rules_start.py``, epoch -1). Every decision is logged (``resource_decision``)
and kept in ``RunResult.decisions``; every profile in ``RunResult.profiles``.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np

from ebrl.config import Offload, RunConfig, SimBackend
from ebrl.runtime.resources import affinity
from ebrl.runtime.resources.controller import decide, postpone_trials
from ebrl.runtime.resources.gpu import GpuStreams, StreamMode
from ebrl.runtime.resources.knobs import MAX_WINDOW_EPOCHS, MIN_STEPS_PER_UNIT, Decision, Knobs, Limits, Memory
from ebrl.runtime.resources.profiler import EpochProfile, LiveProfiler
from ebrl.runtime.resources.rules_sim import lpt_placement
from ebrl.runtime.resources.rules_start import offload_start
from ebrl.runtime.schedules import is_lockstep
from ebrl.runtime.sim import LOCAL
from ebrl.telemetry.logging import get_logger

log = get_logger("ebrl.resources")


def fixed_knobs(cfg: RunConfig) -> frozenset[str]:
    """The knobs the user set explicitly: the controller leaves them alone."""
    sim, gen = cfg.sim, cfg.generation
    set_by_user = {"lanes": sim.num_threads is not None or sim.num_workers is not None,
                   "workers": sim.num_workers is not None, "max_wait_s": gen.max_wait_s is not None,
                   # lockstep: a group is one batch
                   "batch_target": gen.batch_target is not None or is_lockstep(cfg.schedule),
                   "offload": gen.offload is not Offload.AUTO}
    return frozenset(knob for knob, fixed in set_by_user.items() if fixed)


class ResourceManager:
    def __init__(self, cfg: RunConfig, profiler: LiveProfiler, pool, driver, generator, cpus: int,
                 streams: GpuStreams | None = None, learner=None, learner_threads: int | None = None,
                 start: list[Decision] = ()):
        self.cfg, self.profiler, self.pool, self.driver, self.generator = cfg, profiler, pool, driver, generator
        self.learner = learner
        remote = learner.worker.pid if learner is not None else None  # a learner process's
        # the learner process's torch threads, when the controller may change them
        self._threads = learner_threads if remote is not None and cfg.resources.learner_threads is None else None
        # envs on worker processes that can move (checked once): placement, workers, backend
        self.elastic = pool if pool.movable else None
        self.mixed = self.elastic is not None and self.elastic.mixed  # envs may move between lanes and workers
        self._affinity = ("shared" if remote is not None and self.elastic is not None
                          and cfg.resources.affinity and affinity.available() else None)
        self._cores = sorted(os.sched_getaffinity(0)) if self._affinity else []
        self.streams = streams if streams is not None and streams.mode is StreamMode.GREEN_CONTEXTS else None
        self.profiles: list[EpochProfile] = []
        self.decisions: list[Decision] = []
        for d in start:  # made before the pool was built (rules_start.py): kept and logged like the rest
            self._record(d)
        self.memory = Memory()
        self._retire_to: int | None = None  # workers to keep once the envs moving off the rest have moved
        # workers to start (forks run off the loop, in run()), then the placement to move to (None: by cost)
        self._grow_to: tuple[int, tuple[int, ...] | None] | None = None
        self.limits = Limits(num_units=cfg.num_envs // cfg.sim.vector_size, num_envs=cfg.num_envs,
                             cpus=len(self._cores) if self._cores else cpus,
                             # an offload decided at the start (a device policy's: rules_start) holds
                             fixed=fixed_knobs(cfg) | {d.knob for d in start if d.knob == "offload"},
                             lane_wait_above=cfg.resources.lane_wait_above,
                             imbalance_above=cfg.resources.imbalance_above,
                             total_sms=self.streams.total_sms if self.streams else 0,
                             sm_granularity=self.streams.granularity if self.streams else 8,
                             inline_up_to_s=cfg.generation.inline_below_s)
        self._resizable = pool.resizable and (pool.backend is SimBackend.THREAD or self.mixed)
        # envs move between workers only one by one (vector envs stay where they are built)
        self._movable = self.elastic is not None and cfg.sim.vector_size == 1
        self.knobs = self._current()
        # knob -> setter: the controller's decisions act through these alone
        self._actuators = {"lanes": lambda n: self.pool.resize(int(n)), "placement": self._move_to,
                           "backend": self._to_backend, "workers": self._set_workers,
                           "learner_threads": self._set_threads, "affinity": self._set_affinity,
                           **generator.actuators()}
        if self.streams is not None:
            # between batches and updates would be safer; resplit waits for both streams first
            self._actuators["gen_sms"] = lambda sms: self.streams.resplit(int(sms))

    @property
    def _workers(self) -> int | None:
        return None if self.elastic is None else self.elastic.workers

    def _current(self) -> Knobs:
        """The knobs as the pool and generator have them now (a failed migration leaves an env put)."""
        pool = self.pool
        placement = pool.placement if self._movable else None
        lanes = (pool.lanes if self.mixed else pool.size) if self._resizable else None
        return Knobs(backend=pool.backend.value, lanes=lanes, workers=self._workers, mixed=self.mixed,
                     placement=None if placement is None else tuple(int(w) for w in placement),
                     max_wait_s=self.generator.max_wait_s,
                     gen_sms=self.streams.split.generation if self.streams and self.streams.split else None,
                     learner_threads=self._threads, affinity=self._affinity,
                     offload=self.generator.offload_mode.value if self.generator.stage.threads else None,
                     batch_target=self.generator.batch_target)

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            if self.generator.offload is Offload.AUTO and self.generator.stage.threads:
                tg.create_task(self._start_offload(), name="ebrl-offload-start")
            epoch_s = self.cfg.resources.epoch_s
            while True:
                await asyncio.sleep(epoch_s)
                if not self.profiler.window_done(MIN_STEPS_PER_UNIT * self.limits.num_units,
                                                 MAX_WINDOW_EPOCHS * epoch_s * 0.999):
                    continue  # too few env steps to judge by yet: the window grows
                self.epoch()
                if self._grow_to is not None:
                    await self._grow()

    async def _start_offload(self) -> None:
        """Resolve ``generation.offload="auto"`` from the first measured policy call, at once:
        the first epoch is a second away, and a 40 ms call inline stalls the loop meanwhile."""
        await self.generator.measured.wait()
        self._apply(offload_start(self.generator.first_inline_cpu_s, self.limits.inline_up_to_s))

    async def _grow(self) -> None:
        """Start the workers a ``workers`` or ``backend`` decision asked for, then move envs
        onto them (by cost, or where the ``backend`` decision placed them)."""
        (n, placement), self._grow_to = self._grow_to, None
        await self.elastic.grow(n)
        if placement is not None:
            self._move_to(placement)
        else:
            self._place_on(n)

    def _move_to(self, placement) -> None:
        now = self.elastic.placement
        self.driver.moves.wanted = {i: int(w) for i, w in enumerate(placement) if now[i] != w}

    def epoch(self) -> list[Decision]:
        """Take this epoch's profile; decide and apply (with ``resources.adapt``)."""
        profile = self.profiler.take()
        self.profiles.append(profile)
        self.knobs = self._current()
        if not self.cfg.resources.adapt:
            return []
        moving = self.driver.moves.pending  # a placement read now would be stale
        retired = self._retire_to is not None and not moving and self._retire()
        if retired:
            # the knobs read above still count the retired workers: a decision from them could
            # place envs on a worker that is gone. The window ran on the old pool: decide next epoch
            self.knobs = self._current()
        if retired or moving or self._grow_to is not None:  # a change under way: nothing else changes
            postpone_trials(self.memory, profile.epoch)
            return []
        decisions = decide(profile, self.knobs, self.limits, self.memory)
        for d in decisions:
            self._apply(d)
        return decisions

    def _record(self, d: Decision) -> None:
        self.decisions.append(d)
        log.info("resource_decision", epoch=d.epoch, knob=d.knob, old=_short(d.old), new=_short(d.new),
                 reason=d.reason)

    def _retire(self) -> bool:
        """The envs have left the workers past ``_retire_to``: retire those workers (unless a
        migration failed and left an env there, which keeps its worker). True if it did."""
        n, self._retire_to = self._retire_to, None
        left = np.flatnonzero(self.elastic.placement >= n).tolist()
        if left:
            log.warning("workers_kept", workers=self._workers, wanted=n, envs_left=left)
            return False
        self.elastic.resize_workers(n)
        return True

    def _place_on(self, n: int) -> None:
        """Place every env on workers ``0..n-1`` by measured cost per step (longest first),
        keeping as many where they are as possible; they move at their episode ends."""
        profile = self.profiles[-1]
        now = self.elastic.placement
        on = now != LOCAL  # a mixed pool's envs on the lanes stay there
        costs = np.nan_to_num(profile.mean_step_s[on], nan=float(np.nanmean(profile.mean_step_s)))
        new = now.copy()
        new[on] = lpt_placement(costs, n, np.minimum(now[on], n - 1))
        self._move_to(new.tolist())

    def _set_affinity(self, mode: str) -> None:
        plan = affinity.split_plan(self._cores, self._workers) if mode == "split" else None
        if plan is None:  # back to sharing every core the run started with
            plan = {"loop": self._cores, "learner": self._cores, "workers": self._cores}
        affinity.pin(os.getpid(), plan["loop"])
        affinity.pin(self.learner.worker.pid, plan["learner"])
        for pid in self.elastic.worker_pids():
            affinity.pin(pid, plan["workers"])
        self._affinity = mode

    def close(self) -> None:
        """Give this process back every core it started with (the children end with the run)."""
        if self._affinity == "split":
            affinity.pin(os.getpid(), self._cores)
            self._affinity = "shared"
        self.profiler.close()

    def finish(self) -> None:
        """The run ended: its last, partial window is a profile too (short runs get at least one)."""
        if self.profiler.window_s > 0:
            self.profiles.append(self.profiler.take())

    def _apply(self, d: Decision) -> None:
        """Act on ``d`` and record it."""
        act = self._actuators.get(d.knob)
        if act is None:  # a rule without an actuator is a bug
            raise ValueError(f"no actuator for knob {d.knob!r}")
        act(d.new)
        self._record(d)

    def _to_backend(self, placement: tuple[int, ...]) -> None:
        """Envs between lanes and workers (a mixed pool): the workers start first."""
        need = max(placement) + 1
        local = sum(w == LOCAL for w in placement)
        if local > self.pool.lanes and "lanes" not in self.limits.fixed:
            self.pool.resize(local)  # only envs whose steps wait go to the lanes: a lane each
        if need > self.elastic.workers:
            self._grow_to = (need, tuple(placement))
        else:
            self._move_to(placement)

    def _set_workers(self, n: int) -> None:
        n = int(n)
        if n > self._workers:
            self._grow_to = (n, None)
        else:
            self._place_on(n)
            self._retire_to = n

    def _set_threads(self, n: int) -> None:
        self._threads = int(n)
        self.learner.threads = self._threads  # sent with the next update


def _short(value):
    if isinstance(value, tuple) and len(value) > 8:
        return f"{len(value)} entries"
    return value
