"""The start-up probe: env 0 built, its facts read, and under ``sim.backend="auto"`` its step
timed, every phase under a deadline.

``run()`` needs env 0's spaces and time limit before it starts anything (the policy is checked
against them), and AUTO needs a measured step to choose the backend. Both come from one env,
in phases:

1. build ``env_fn(0)`` (deadline ``faults.build_timeout_s``), then under AUTO reset it (the same);
2. send its :class:`~ebrl.runtime.env_facts.EnvFacts`, and wait: the parent checks the trainer
   against them, so a policy that does not fit the env fails before any env is stepped;
3. under AUTO, on the parent's word, time its steps (each under ``faults.step_timeout_s``).

Where envs may live in child processes (``auto``, ``process``, ``mixed``), the probe runs in a
child forked from this still clean process (:mod:`ebrl.runtime.children`): a build that holds
the GIL does not stall the caller's loop, the child's CPU clock is the probe's own, and no
renderer's driver is loaded here before the workers fork. Elsewhere (``inline``, ``thread``, a
vector env: the envs live here anyway), and where this process is no longer clean to fork (a
fork server's child would not see what this process set up: a registered env, a patched
module), it runs in a thread of this process. A phase past its deadline ends ``run()`` with one
:class:`~ebrl.runtime.errors.EnvStepError` naming env 0, the phase and the setting; the child
is killed and reaped whatever happens, cancellation included (a thread stuck in the env is left
to it, never joined on the loop).

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

import asyncio
import contextlib
import os
import queue
import time
from dataclasses import dataclass
from multiprocessing.context import BaseContext

from ebrl.config import FaultConfig, SimBackend, SimConfig
from ebrl.runtime.children import child_context, helpers_scope, portable
from ebrl.runtime.children import start as start_child
from ebrl.runtime.env_facts import EnvFacts
from ebrl.runtime.errors import EnvStepError, TimedOut
from ebrl.runtime.sim.stepping import EnvFn, close_quietly, describe
from ebrl.runtime.threads import ignore_stop_signals, in_thread
from ebrl.telemetry.logging import get_logger

log = get_logger("ebrl.sim")

# the probe's rounds take about this long each (10 steps at least): every env's first step waits
# for the probe, and telling a step that computes from one that waits needs no more
PROBE_ROUND_S = 0.015
# the clocks a step is timed on: wall seconds, and the CPU seconds of the whole process (tests
# replace them with clocks their env drives, so the measured step is exactly the declared one)
STEP_CLOCKS = (time.perf_counter, time.process_time)
# the child's phases, as it writes them to the shared beat (phase, monotonic start time)
BUILD, RESET, WAIT, STEP = 0.0, 1.0, 2.0, 3.0
_PHASES = {BUILD: ("env_fn", "build_timeout_s"), RESET: ("reset", "build_timeout_s"), STEP: ("step", "step_timeout_s")}
_POLL_S = 0.05  # how often the parent looks at the beat while no message comes
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


class EnvProbe:
    """Env 0 in a child process, or in a thread of this one (see the module docstring); an async
    context manager."""

    def __init__(self, env_fn: EnvFn, sim: SimConfig, faults: FaultConfig, executor=None):
        self.env_fn, self.sim, self.faults = env_fn, sim, faults
        # the platform's executor (ebrl.runtime.platform): one without threads probes inline
        self.inline = executor is not None and not executor.threads
        self.executor = executor
        self.env = None
        self.measure = sim.backend is SimBackend.AUTO and sim.vector_size == 1
        self.proc = self.conn = self.thread = None
        self.beat = [BUILD, 0.0]  # a shared array for a child
        self._helpers = contextlib.ExitStack()  # a fork server its child needs ends with it

    def _child_start(self) -> BaseContext | None:
        """The context to start the probe's child with, or None for a thread: a child where envs
        may live in children (``auto``, ``process``, ``mixed``) and one can start clean (fork
        from a clean process, or a start method the user set); else a thread, where the envs
        live here anyway or a fork server's child would not see this process's state (an env
        registered, a module patched) that a fork would carry."""
        if self.sim.vector_size > 1 or self.sim.backend in (SimBackend.INLINE, SimBackend.THREAD):
            return None
        ctx, why = child_context(self.sim.start_method)
        if ctx.get_start_method() != "fork" and self.sim.start_method is None:
            log.info("sim_probe_in_thread", why=why)
            return None
        return ctx

    async def __aenter__(self) -> EnvProbe:
        if self.inline:
            return self
        ctx = self._child_start()
        if ctx is None:
            self.conn = _ThreadConn(asyncio.get_running_loop())
            self.thread = asyncio.ensure_future(in_thread(
                _probe_main, self.conn.far_end(), self.env_fn, self.measure, self.beat, False,
                name="ebrl-sim-probe", may_hang=True))
            return self
        self._helpers.enter_context(helpers_scope())
        self.beat = ctx.RawArray("d", 2)
        parent, child = ctx.Pipe(duplex=True)
        self.conn = _PipeConn(parent)
        self.proc = ctx.Process(target=_probe_main, name="ebrl-sim-probe", daemon=True,
                                args=(child, portable(self.env_fn, ctx), self.measure, self.beat))
        proc, conn = self.proc, self.conn

        def start() -> None:
            start_child(proc, ctx)
            child.close()

        # off the loop: a fork copies this process's page tables. Cancelled meanwhile, the thread
        # still finishes the start, and ends what it started
        starting = asyncio.ensure_future(in_thread(start, name="ebrl-sim-probe-start"))
        try:
            await asyncio.shield(starting)
        except BaseException:
            starting.add_done_callback(lambda _: (_end(proc, conn, 0.0), self._helpers.close()))
            raise
        return self

    async def facts(self) -> EnvFacts:
        """Env 0's facts: built (and under AUTO reset), never stepped."""
        if self.inline:
            return self._inline_facts()
        return (await self._next())[1]

    def _inline_facts(self) -> EnvFacts:
        op = "env_fn"
        try:
            self.env = self.env_fn(0)
            facts = EnvFacts.of(self.env)
            if self.measure:
                op = "reset"
                self.env.reset(seed=0)
        except Exception as exc:
            raise EnvStepError(0, op, describe(exc)) from exc
        return facts

    async def step_profile(self) -> StepProfile | None:
        """Under AUTO for plain envs, env 0's measured step (after :meth:`facts`); else None."""
        if not self.measure:
            return None
        if self.inline:
            env, clocks = self.executor.metered(self.env)
            try:
                step = _time_steps(env, lambda: None, clocks=clocks)
            except Exception as exc:
                raise EnvStepError(0, "step", describe(exc)) from exc
        else:
            self.conn.send("go")
            step = (await self._next())[1]
        log.info("sim_step_probed", step_wall_us=round(step.wall_s * 1e6, 1), step_cpu_us=round(step.cpu_s * 1e6, 1),
                 busy=round(step.busy, 3), declared_releases_gil=step.releases_gil)
        return step

    async def __aexit__(self, *exc) -> None:
        if self.inline:
            if self.env is not None:
                close_quietly(self.env)
            return
        if self.thread is not None:  # told to stop, it closes env 0; one stuck in the env is left to it
            self.conn.send("stop")
            if exc[0] is None:
                await asyncio.wait([self.thread], timeout=_REAP_S)
            if not self.thread.done():
                self.thread.cancel()
            return
        proc, conn = self.proc, self.conn
        try:
            if exc[0] is None:  # it is exiting by itself: reaped off the loop
                await in_thread(_end, proc, conn, _REAP_S, name="ebrl-sim-probe-reap")
            else:  # a failure or a cancel: killed at once (a killed process is reaped in milliseconds)
                _end(proc, conn, 0.0)
        finally:
            self._helpers.close()

    async def _next(self) -> tuple:
        """The probe's next message, waiting under the current phase's deadline."""
        while True:
            msg = self.conn.take()
            if msg is not None:
                if msg[0] == "error":
                    raise EnvStepError(0, msg[1], msg[2])
                return msg
            phase, started = self.beat[0], self.beat[1]
            op = _PHASES.get(phase, ("probe",))[0]
            if self.proc is not None and not self.proc.is_alive():
                self.proc.join(_REAP_S)
                raise EnvStepError(0, op, f"the sim probe's process exited (exit code {self.proc.exitcode})")
            if self.thread is not None and self.thread.done():
                self.thread.result()  # raises what ended it
                raise EnvStepError(0, op, "the sim probe's thread ended without an answer")
            limit = getattr(self.faults, _PHASES[phase][1]) if phase in _PHASES else None
            if limit is not None and started and time.monotonic() - started > limit:
                if self.proc is not None:
                    self.proc.kill()
                raise self._timed_out(phase)
            await self.conn.wait(_POLL_S)

    def _timed_out(self, phase: float) -> EnvStepError:
        op, setting = _PHASES[phase]
        where = "its process was killed" if self.proc is not None else "its thread was left"
        what = {"env_fn": "build", "reset": "reset", "step": "step"}[op]
        return EnvStepError(0, op, TimedOut(f"its {what} in the sim probe ran past faults.{setting}="
                                            f"{getattr(self.faults, setting):g} s; {where}"))


class _PipeConn:
    """The loop's end of the probe child's pipe (send, take, wait)."""

    def __init__(self, conn):
        self.conn = conn

    def send(self, msg) -> None:
        self.conn.send(msg)

    def take(self):
        if not self.conn.poll():
            return None
        try:
            return self.conn.recv()
        except EOFError:  # the child is gone: _next sees it exit
            return None

    async def wait(self, timeout: float) -> None:
        loop, fd = asyncio.get_running_loop(), self.conn.fileno()
        readable = loop.create_future()
        loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
        try:
            await asyncio.wait({readable}, timeout=timeout)
        finally:
            loop.remove_reader(fd)
            # add_reader made the socket non-blocking: a message larger than its buffer would then
            # fail half-way in recv (a message has started: the rest comes at once)
            os.set_blocking(fd, True)

    def close(self) -> None:
        self.conn.close()


class _ThreadConn:
    """The probe's messages between the loop and a thread of this process, shaped as the child's
    pipe is (send, and on the loop's side take and wait)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()

    def send(self, msg) -> None:  # the loop's side
        self.outbox.put(msg)

    def take(self):
        return None if self.inbox.empty() else self.inbox.get_nowait()

    async def wait(self, timeout: float) -> None:
        getter = asyncio.ensure_future(self.inbox.get())
        done, _ = await asyncio.wait([getter], timeout=timeout)
        if getter in done:
            self.inbox.put_nowait(getter.result())  # back, for take()
        else:
            getter.cancel()

    def far_end(self) -> _ThreadEnd:
        return _ThreadEnd(self)


class _ThreadEnd:
    """The probe thread's side of a :class:`_ThreadConn`."""

    def __init__(self, conn: _ThreadConn):
        self.conn = conn

    def send(self, msg) -> None:
        try:
            self.conn.loop.call_soon_threadsafe(self.conn.inbox.put_nowait, msg)
        except RuntimeError:  # the loop closed: nobody listens
            pass

    def recv(self):
        return self.conn.outbox.get()

    def close(self) -> None:
        pass


def _end(proc, conn, wait_s: float) -> None:
    """Tell the child to stop, give it ``wait_s`` to exit, then kill and reap it."""
    try:
        conn.send("stop")
    except (OSError, ValueError):
        pass
    if proc.pid is not None:  # started
        proc.join(wait_s)
        if proc.is_alive():
            proc.kill()
            proc.join(_REAP_S)
    conn.close()


def _probe_main(conn, env_fn: EnvFn, measure: bool, beat, child: bool = True) -> None:
    """The probe (a child process, or a thread): the phases of the module docstring, each
    written to ``beat`` as it starts."""
    if child:
        ignore_stop_signals()
    op, env = "env_fn", None

    def phase(code: float) -> None:
        beat[1] = time.monotonic()
        beat[0] = code

    try:
        phase(BUILD)
        env = env_fn(0)
        facts = EnvFacts.of(env)
        if measure:
            op = "reset"
            phase(RESET)
            env.reset(seed=0)
        phase(WAIT)
        conn.send(("facts", facts))
        if not measure or conn.recv() != "go":
            return
        op = "step"
        conn.send(("step", _time_steps(env, lambda: phase(STEP))))
    except (EOFError, BrokenPipeError):
        pass  # the parent has gone or given up
    except Exception as exc:
        try:
            conn.send(("error", op, describe(exc)))
        except OSError:
            pass
    finally:
        if env is not None:
            close_quietly(env)
        conn.close()


def _time_steps(env, before_step, steps: int = 100, rounds: int = 3, clocks=None) -> StepProfile:
    """Wall and CPU seconds per random-action step of a reset ``env`` (the round with the least
    wall time of ``rounds``, after a 10-step warm-up), and whether the env says it releases the
    GIL. A round is ``steps`` steps, fewer for a slow env (about ``PROBE_ROUND_S`` a round, at
    least 10 steps): the controller refines the choice from live numbers, so the probe only has
    to tell a step that computes from one that waits."""
    env.action_space.seed(0)
    actions = [env.action_space.sample() for _ in range(steps)]

    wall_clock, cpu_clock = clocks or STEP_CLOCKS

    def one_round(n: int) -> tuple[float, float]:
        t0, c0 = wall_clock(), cpu_clock()
        for a in actions[:n]:
            before_step()
            _, _, term, trunc, _ = env.step(a)
            if term or trunc:
                env.reset()
        return (wall_clock() - t0) / n, (cpu_clock() - c0) / n

    first, _ = one_round(min(10, steps))  # warm-up: first calls pay for caches and lazy imports
    n = max(min(10, steps), min(steps, int(PROBE_ROUND_S / max(first, 1e-9))))
    wall, cpu = min(one_round(n) for _ in range(rounds))
    return StepProfile(wall, cpu, bool(env.metadata.get("ebrl.releases_gil", False)))
