"""What ``run()`` builds the runtime on: the parts that tests and emulation replace.

``run()`` never asks what kind of machine it is on; it asks its :class:`Platform` where blocking
calls run (:class:`Threads`: each stage's in a :class:`~ebrl.runtime.stage.Stage`, one-off calls
off the loop under a deadline, the cores, whether child processes may start), for the sim pool,
for the device a policy runs on (:func:`device_of`) and for the system sampler. The event loop is
the clock: every deadline and cost is read from ``loop.time()``. :func:`ebrl.testing.virtual_platform`
swaps in virtual time's parts, which run every call inline and charge its declared cost on the
loop's virtual clock, through the same probe, start rules, controller and evaluation code.

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


class Threads:
    """The executor of real hardware, and the interface of every executor: each stage's calls in a
    thread of its own, one-off calls in a private thread, the cores this process may use."""

    processes = True  # whether child processes may be started (sim workers, the learner process)
    threads = True  # whether calls may run in threads (else inline on the loop)

    def cpus(self) -> int:
        return usable_cpus()

    def stage(self, name: str, owner: Any) -> Stage:
        """The stage running ``owner``'s calls (a policy's, an algorithm's)."""
        return Stage(name)

    async def call(self, fn: Callable[..., T], *args: Any, name: str, may_hang: bool = False,
                   timeout_s: float | None = None) -> T:
        """``fn(*args)`` off the loop (:func:`~ebrl.runtime.threads.in_thread`'s contract)."""
        return await in_thread(fn, *args, name=name, may_hang=may_hang, timeout_s=timeout_s)

    def metered(self, env) -> tuple[Any, tuple[Callable[[], float], Callable[[], float]]]:
        """``env`` as the start-up probe steps it, and the wall and CPU clocks it times a step on."""
        from ebrl.runtime.probe import STEP_CLOCKS

        return env, STEP_CLOCKS


class Device(Protocol):
    """A device a policy runs on, as the runtime sees it (:class:`TorchDevice`, an emulated one)."""

    name: str | None  # "cuda", "the emulated device pi0-h200": what the start rules and errors name
    in_process_only: bool  # whether training must stay in this process (beside generation)

    def streams(self, mode: StreamMode):
        """Generation and training streams in ``mode`` (or the richest mode below it that works)."""

    def nvml(self) -> Any:
        """The NVML module the system sampler reads (None: the real one, imported if present)."""


@dataclass(frozen=True)
class TorchDevice:
    """A policy's torch device: CUDA, the CPU, or none (a policy without parameters)."""

    device: torch.device | None
    in_process_only = False

    @property
    def name(self) -> str | None:
        return None if self.device is None else self.device.type

    def streams(self, mode: StreamMode):
        if self.name != "cuda":
            return None
        from ebrl.runtime.resources.gpu import GpuStreams

        return GpuStreams.create(device=self.device, max_mode=mode)

    def nvml(self) -> Any:
        return None


def policy_device(policy) -> torch.device | None:
    """The device of a torch policy's first parameter; None for a policy without parameters."""
    params = getattr(policy, "parameters", None)
    first = next(iter(params()), None) if callable(params) else None
    return None if first is None else first.device


def device_of(policy) -> Device:
    """The device ``policy`` runs on: the one it carries (``policy.runtime_device``: an emulated
    device, :mod:`ebrl.emulated`), else its parameters'."""
    carried = getattr(policy, "runtime_device", None)
    return carried if carried is not None else TorchDevice(policy_device(policy))


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

    executor: Threads = field(default_factory=Threads)  # or any object with its interface
    sim_pool: Callable[..., Any] = _sim_pool  # SimPool's signature
    device: Callable[[Any], Device] = device_of
    sampler: Callable[[Any], Any] = system_sampler  # nvml -> a SystemSampler, or None for none
    # the event loop run_sync() makes (None: uvloop's where installed, else asyncio's)
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
