"""What ``run()`` builds the runtime on: the parts that tests and emulation replace.

``run()`` never asks what kind of machine it is on; it asks its :class:`Platform`:

- **where blocking calls run** (:class:`Threads`): each stage's calls (the generator's policy
  calls, the learner's updates) in a :class:`~ebrl.runtime.stage.Stage`, and one-off calls (an
  env's build, an evaluation episode) off the loop under a deadline; how many cores there are,
  and whether child processes may be started;
- **the sim pool** (:class:`~ebrl.runtime.sim.pool.SimPool` by default);
- **the device** a policy runs on (:func:`device_of`: a CUDA device, an emulated one the policy
  carries, or none for the CPU) and its streams;
- **the system sampler** (cores and GPUs, :class:`~ebrl.telemetry.system.SystemSampler`).

The event loop is the clock: every deadline and every cost is read from ``loop.time()``.
:func:`ebrl.testing.virtual_platform` swaps in a virtual-time one, which runs every call inline
and charges its declared cost on the loop's virtual clock; :func:`ebrl.testing.run_virtual`
runs on it. Both go through the same probe, start rules, controller and evaluation code.

    >>> platform = Platform()
    >>> platform.executor.processes, platform.executor.cpus() >= 1
    (True, True)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from ebrl.config import StreamMode
from ebrl.runtime.stage import Stage
from ebrl.runtime.threads import in_thread, usable_cpus

T = TypeVar("T")


class Executor(Protocol):
    """Where the runtime's blocking calls run."""

    processes: bool  # whether child processes may be started (sim workers, the learner process)
    threads: bool  # whether calls may run in threads (else inline on the loop)

    def cpus(self) -> int: ...

    def stage(self, name: str, owner: Any) -> Stage:
        """The stage running ``owner``'s calls (a policy's, an algorithm's)."""

    async def call(self, fn: Callable[..., T], *args: Any, name: str, may_hang: bool = False,
                   timeout_s: float | None = None) -> T:
        """``fn(*args)`` off the loop (:func:`~ebrl.runtime.threads.in_thread`'s contract)."""

    def metered(self, env) -> tuple[Any, tuple[Callable[[], float], Callable[[], float]]]:
        """``env`` as the start-up probe steps it, and the wall and CPU clocks it times a step on."""


class Threads:
    """Real hardware: each stage's calls in a thread of its own, one-off calls in a private thread,
    the cores this process may use."""

    processes = True
    threads = True

    def cpus(self) -> int:
        return usable_cpus()

    def stage(self, name: str, owner: Any) -> Stage:
        return Stage(name)

    async def call(self, fn: Callable[..., T], *args: Any, name: str, may_hang: bool = False,
                   timeout_s: float | None = None) -> T:
        return await in_thread(fn, *args, name=name, may_hang=may_hang, timeout_s=timeout_s)

    def metered(self, env) -> tuple[Any, tuple[Callable[[], float], Callable[[], float]]]:
        from ebrl.runtime.probe import STEP_CLOCKS

        return env, STEP_CLOCKS


class Device(Protocol):
    """A device a policy runs on, as the runtime sees it."""

    name: str  # "cuda", "the emulated device pi0-h200": what the start rules and errors name
    in_process_only: bool  # whether training must stay in this process (beside generation)

    def streams(self, mode: StreamMode):
        """Generation and training streams in ``mode`` (or the richest mode below it that works)."""

    def nvml(self) -> Any:
        """The NVML module the system sampler reads (None: the real one, imported if present)."""


@dataclass(frozen=True)
class CudaDevice:
    """A policy on a CUDA device."""

    device: torch.device
    in_process_only: bool = False

    @property
    def name(self) -> str:
        return self.device.type

    def streams(self, mode: StreamMode):
        from ebrl.runtime.resources.gpu import GpuStreams

        return GpuStreams.create(device=self.device, max_mode=mode)

    def nvml(self) -> Any:
        return None


@dataclass(frozen=True)
class CpuDevice:
    """A policy on the CPU (or without parameters: ``name`` None)."""

    name: str | None = "cpu"
    in_process_only: bool = False

    def streams(self, mode: StreamMode):
        return None

    def nvml(self) -> Any:
        return None


def policy_device(policy) -> torch.device | None:
    """The device of a torch policy's first parameter; None for a policy without parameters."""
    params = getattr(policy, "parameters", None)
    first = next(iter(params()), None) if callable(params) else None
    return None if first is None else first.device


def device_of(policy) -> Device:
    """The device ``policy`` runs on: the one it carries (``policy.runtime_device``: an emulated
    device, :mod:`ebrl.emulated`), else its parameters' (CUDA or the CPU)."""
    carried = getattr(policy, "runtime_device", None)
    if carried is not None:
        return carried
    device = policy_device(policy)
    if device is None:
        return CpuDevice(None)
    return CudaDevice(device) if device.type == "cuda" else CpuDevice(device.type)


def system_sampler(nvml: Any):
    """Cores and GPUs (through ``nvml``), sampled for the controller and the metrics."""
    from ebrl.telemetry.system import SystemSampler

    return SystemSampler(nvml=nvml)


def _sim_pool(*args, **kwargs):
    from ebrl.runtime.sim import SimPool

    return SimPool(*args, **kwargs)


@dataclass(frozen=True)
class Platform:
    """The parts ``run()`` assembles the runtime from (see the module docstring)."""

    executor: Executor = field(default_factory=Threads)
    sim_pool: Callable[..., Any] = _sim_pool  # SimPool's signature
    device: Callable[[Any], Device] = device_of
    sampler: Callable[[Any], Any] = system_sampler  # nvml -> a SystemSampler, or None for none
    # the event loop run_sync() makes (None: uvloop's where installed, else asyncio's)
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
