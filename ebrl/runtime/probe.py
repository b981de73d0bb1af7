"""The start-up probe: env 0 built and its facts read (``run()`` checks the policy against its
spaces and time limit before anything starts), and under ``sim.backend="auto"`` its step timed
(AUTO chooses the backend from it). The requests are :class:`Env0`'s methods: ``build``, under
AUTO ``reset``, and ``facts``, each under ``faults.build_timeout_s``; then under AUTO ``steps``,
each under ``faults.step_timeout_s`` (the warm-up's steps one by one, then rounds of about
``PROBE_ROUND_S``).

Where envs may live in child processes (``auto``, ``process``, ``mixed``), env 0 lives in a child
forked from this still clean process (:class:`~ebrl.runtime.children.Child`): a build holding the
GIL does not stall the caller's loop, the child's CPU clock is the probe's own, and no renderer's
driver is loaded here before the workers fork. Elsewhere (the envs live here anyway), and where
this process is no longer clean to fork (a fork server's child would not see a registered env or
a patched module), it lives in a thread of this process; ``where="inline"``, on the caller's
thread, with no deadline (virtual time). A request past its deadline fails as env 0's
:class:`~ebrl.runtime.errors.EnvStepError`; the child is killed and reaped whatever happens (a
thread stuck in the env is left to it, never joined on the loop).

    >>> import asyncio
    >>> from ebrl.config import FaultConfig, SimConfig
    >>> from ebrl.testing import MockEnv
    >>> async def demo():
    ...     async with EnvProbe(lambda i: MockEnv(dim=3), SimConfig(backend="auto"), FaultConfig()) as probe:
    ...         facts = await probe.facts()      # built and reset; nothing stepped yet
    ...         step = await probe.step_profile()
    ...     return facts.action_space.shape, step.wall_s > 0
    >>> asyncio.run(demo())
    ((3,), True)
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from typing import Any, Literal

from ebrl.config import FaultConfig, SimBackend, SimConfig
from ebrl.runtime.children import Child, ChildDied, ChildFailed, child_context, serve
from ebrl.runtime.env_facts import EnvFacts
from ebrl.runtime.errors import EnvStepError, TimedOut
from ebrl.runtime.sim.stepping import EnvFn, close_quietly, describe
from ebrl.runtime.threads import in_thread
from ebrl.telemetry.logging import get_logger

log = get_logger("ebrl.sim")

# the probe's rounds take about this long each (10 steps at least): every env's first step waits
# for the probe, and telling a step that computes from one that waits needs no more
PROBE_ROUND_S = 0.015
STEPS, ROUNDS, WARM_UP = 100, 3, 10  # steps a round at most, rounds timed, warm-up steps
# the clocks a step is timed on: wall seconds, and the CPU seconds of the whole process (tests
# replace them with clocks their env drives, so the measured step is exactly the declared one)
STEP_CLOCKS = (time.perf_counter, time.process_time)
# each request: the phase an error names, the deadline's setting, and what ran past it
_REQUESTS = {"build": ("env_fn", "build_timeout_s", "build"), "reset": ("reset", "build_timeout_s", "reset"),
             "facts": ("env_fn", "build_timeout_s", "build"), "steps": ("step", "step_timeout_s", "step"),
             "releases_gil": ("step", "step_timeout_s", "step")}
_REAP_S = 1.0  # how long a finished child is given to exit before it is killed


@dataclass(frozen=True)
class StepProfile:
    """What the AUTO probe measured of one env's step."""

    wall_s: float  # seconds per step
    # CPU seconds per step, of the whole child process (process_time): ~0 for a step that waits; a
    # simulator's own helper threads count (Mesa's llvmpipe renders on several)
    cpu_s: float
    releases_gil: bool  # the env says so (``metadata["ebrl.releases_gil"]``)

    @property
    def busy(self) -> float:
        """The fraction of a step spent computing (1: CPU-bound; near 0: sleeping or waiting on a
        device or a C++ simulator that released the GIL)."""
        return min(1.0, self.cpu_s / self.wall_s) if self.wall_s > 0 else 1.0


class Env0:
    """Env 0 and the probe's requests on it, wherever they run (a child, a thread, inline)."""

    def __init__(self, env_fn: EnvFn, metered=None):
        self.env_fn, self.env, self.actions = env_fn, None, []
        self.metered = metered  # env -> (env as stepped, (wall clock, CPU clock)): the platform's
        self.clocks = STEP_CLOCKS

    def build(self) -> None:
        self.env = self.env_fn(0)
        if self.metered is not None:
            self.env, self.clocks = self.metered(self.env)

    def reset(self) -> None:
        self.env.reset(seed=0)

    def facts(self) -> EnvFacts:
        return EnvFacts.of(self.env)

    def steps(self, start: int, n: int) -> tuple[float, float]:
        """Wall and CPU seconds of random-action steps ``start..start+n`` (the same actions each
        round), resetting where an episode ends."""
        if not self.actions:
            self.env.action_space.seed(0)
            self.actions = [self.env.action_space.sample() for _ in range(STEPS)]
        wall_clock, cpu_clock = self.clocks
        t0, c0 = wall_clock(), cpu_clock()
        for a in self.actions[start:start + n]:
            _, _, term, trunc, _ = self.env.step(a)
            if term or trunc:
                self.env.reset()
        return wall_clock() - t0, cpu_clock() - c0

    def releases_gil(self) -> bool:
        return bool(self.env.metadata.get("ebrl.releases_gil", False))

    def close(self) -> None:
        if self.env is not None:
            close_quietly(self.env)


def _serve_env0(conn, env_fn: EnvFn) -> None:
    with conn:  # closed when it returns: a thread's end shows as a child's
        serve(conn, Env0(env_fn))


class EnvProbe:
    """Env 0 in a child process, a thread, or on the caller's thread (see the module docstring)."""

    def __init__(self, env_fn: EnvFn, sim: SimConfig, faults: FaultConfig, where: Literal["auto", "inline"] = "auto",
                 metered=None):
        self.env_fn, self.sim, self.faults, self.where = env_fn, sim, faults, where
        self.metered = metered  # inline: the platform's clocks for env 0's steps (virtual time: declared costs)
        self.measure = sim.backend is SimBackend.AUTO and sim.vector_size == 1
        self.placement = "inline"  # or "process", "thread": where env 0 is (see __aenter__)
        self.child: Child | None = None  # a process or thread: its handle
        self.env0: Env0 | None = None  # inline: env 0 here

    def _child_start(self) -> BaseContext | None:
        """The context to start the probe's child with, or None for a thread (see the module docstring)."""
        if self.sim.vector_size > 1 or self.sim.backend in (SimBackend.INLINE, SimBackend.THREAD):
            return None
        ctx, why = child_context(self.sim.start_method)
        if ctx.get_start_method() != "fork" and self.sim.start_method is None:
            log.info("sim_probe_in_thread", why=why)
            return None
        return ctx

    async def __aenter__(self) -> EnvProbe:
        if self.where == "inline":
            self.env0 = Env0(self.env_fn, self.metered)
        elif (ctx := self._child_start()) is not None:
            self.placement = "process"  # started off the loop: a fork copies this process's page tables
            self.child = await Child.start_off_loop("ebrl-sim-probe", _serve_env0, self.env_fn, ctx=ctx,
                                                    start_timeout_s=self.faults.build_timeout_s)
        else:
            self.placement = "thread"
            parent, conn = mp.Pipe()
            thread = threading.Thread(target=_serve_env0, args=(conn, self.env_fn), name="ebrl-sim-probe", daemon=True)
            thread.start()
            self.child = Child("ebrl-sim-probe", thread, parent)
        return self

    async def facts(self) -> EnvFacts:
        """Env 0's facts: built (and under AUTO reset), never stepped."""
        await self._ask("build")
        if self.measure:
            await self._ask("reset")
        return await self._ask("facts")

    async def step_profile(self) -> StepProfile | None:
        """Under AUTO for plain envs, env 0's measured step (after :meth:`facts`); else None: the
        fastest of ``ROUNDS`` rounds after a warm-up (first calls pay for caches and lazy imports).
        The controller refines the choice from live numbers: the probe only has to tell a step
        that computes from one that waits."""
        if not self.measure:
            return None
        first, _ = await self._round(WARM_UP, 1)
        fit = int(PROBE_ROUND_S / max(first, 1e-9))  # steps in PROBE_ROUND_S
        n = max(WARM_UP, min(STEPS, fit))
        wall, cpu = min([await self._round(n, max(1, fit)) for _ in range(ROUNDS)])
        step = StepProfile(wall, cpu, await self._ask("releases_gil"))
        log.info("sim_step_probed", step_wall_us=round(step.wall_s * 1e6, 1), step_cpu_us=round(step.cpu_s * 1e6, 1),
                 busy=round(step.busy, 3), declared_releases_gil=step.releases_gil)
        return step

    async def _round(self, n: int, per_request: int) -> tuple[float, float]:
        """Wall and CPU seconds per step of ``n`` steps (``STEPS`` at most), ``per_request`` in each request."""
        wall = cpu = 0.0
        for start in range(0, n, per_request):
            w, c = await self._ask("steps", start, min(per_request, n - start))
            wall, cpu = wall + w, cpu + c
        return wall / n, cpu / n

    async def _ask(self, request: str, *args) -> Any:
        """``request`` where env 0 is, under its deadline; its failure as env 0's :class:`EnvStepError`."""
        op, setting, what = _REQUESTS[request]
        if self.child is None:
            try:
                return getattr(self.env0, request)(*args)
            except Exception as exc:
                raise EnvStepError(0, op, describe(exc)) from exc
        limit = getattr(self.faults, setting)
        try:
            return await self.child.ask(request, *args, timeout_s=limit)
        except ChildFailed as exc:
            raise EnvStepError(0, op, exc.summary) from None
        except ChildDied as exc:
            raise EnvStepError(0, op, f"the sim probe's {self.placement} died ({exc.how})") from None
        except TimeoutError:
            what = what if self.child.heard else "start-up"
            where = "its process was killed" if self.placement == "process" else "its thread was left"
            raise EnvStepError(0, op, TimedOut(f"its {what} in the sim probe ran past faults.{setting}={limit:g} s; "
                                               f"{where}")) from None

    async def __aexit__(self, *exc) -> None:
        if self.env0 is not None:
            self.env0.close()
        elif exc[0] is None:  # it is ending by itself: reaped off the loop
            await in_thread(self.child.reap, _REAP_S, name="ebrl-sim-probe-reap")
        else:  # a failure or a cancel: killed at once (a killed process is reaped in milliseconds)
            self.child.reap()
