"""The controller's first decisions: the config's ``auto`` values, resolved once from what the run
measures before its first window (the probe's step, the policy's device, the first policy call).
Each is a :class:`Decision` of epoch ``START`` (-1), kept in ``RunResult.decisions`` ahead of the
epochs' own; later epochs may change the backend, the lanes and the offload, drawing the same
lines so that neither undoes the other. The rules are described in docs/resources.md.

    >>> from ebrl.config import SimConfig
    >>> from ebrl.runtime.probe import StepProfile
    >>> sleeper = StepProfile(wall_s=1e-3, cpu_s=2e-5, releases_gil=False)  # 1 ms, nearly all asleep
    >>> [(d.knob, d.new) for d in sim_start(sleeper, SimConfig(), num_envs=8, cpus=2)]
    [('backend', 'thread'), ('lanes', 8)]
    >>> offload_start(cpu_s=0.040, line=1e-3).new   # a 40 ms policy call: off the event loop
    'thread'
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ebrl.config import SimConfig
from ebrl.runtime.resources.knobs import Decision

if TYPE_CHECKING:
    from ebrl.runtime.probe import StepProfile

START = -1  # the epoch of a decision made at the start, before the first window
WAITS_BELOW = 0.5  # a step busy less than this fraction of its time mostly waits: threads overlap it


def lanes_for(busy: float, units: int, cpus: int) -> int:
    """Lanes that keep every core stepping when a step keeps ``busy`` of a core busy; at most one per
    unit (a sleeping env gets a lane of its own), at least one per core."""
    return max(1, min(units, max(cpus, math.ceil(cpus / max(busy, 1.0 / max(units, 1))))))


def sim_start(profile: StepProfile, cfg: SimConfig, num_envs: int, cpus: int,
              processes: bool = True) -> list[Decision]:
    """The backend for plain envs under ``sim.backend="auto"``, and the thread lanes where it
    chose threads and ``sim.num_threads`` is unset (an explicit value is never overridden).
    ``processes``: whether the platform may start worker processes."""
    step = f"a step took {profile.wall_s * 1e6:.0f} us, {profile.busy:.0%} of it on a CPU"
    if profile.wall_s < cfg.inline_below_s:
        return [Decision(START, "backend", "auto", "inline",
                         f"{step}: under sim.inline_below_s ({cfg.inline_below_s * 1e6:.0f} us), less than a thread hop")]
    if processes and not (profile.releases_gil or cpus < 2 or profile.busy < WAITS_BELOW):
        return [Decision(START, "backend", "auto", "process",
                         f"{step} holding the GIL: worker processes step such envs in parallel")]
    why = ("the env declares it releases the GIL" if profile.releases_gil
           else "one core: worker processes would gain nothing" if cpus < 2
           else "the platform starts no processes (virtual time): lanes step it" if not processes
           else "it mostly waits: lane threads overlap the waits")
    decisions = [Decision(START, "backend", "auto", "thread", f"{step}; {why}")]
    if cfg.num_threads is None:
        lanes = lanes_for(profile.busy, num_envs, cpus)
        decisions.append(Decision(START, "lanes", None, lanes,
                                  f"{cpus} cores over {profile.busy:.2f} of a core per lane, at most one per env"))
    return decisions


def learner_start(device: str | None, cpus: int, processes: bool = True) -> Decision:
    """The learner under ``learner="auto"``, for a policy whose parameters are on ``device``
    (``"cpu"``, ``"cuda"``, ...; None: it has none): a process of its own when it trains on the
    CPU of a multi-core host that may start one (``processes``), a thread of this process otherwise."""
    if device == "cpu" and cpus >= 2 and processes:
        return Decision(START, "learner", "auto", "process",
                        f"training runs on the CPU and there are {cpus} cores: off the event loop's GIL")
    why = (("one core" if cpus < 2 else "the platform starts no processes (virtual time)") if device == "cpu"
           else "the policy has no parameters" if device is None
           else f"training runs on {device}, on a stream of its own")
    return Decision(START, "learner", "auto", "thread", why)


def device_offload_start(device: str) -> Decision:
    """Where the calls of a policy on ``device`` run under ``generation.offload="auto"``: in the
    generator's thread, held for the run (the manager fixes the knob when this decision is made):
    a call waits for the device, and its wall time over its CPU time is that wait, not the GIL's."""
    return Decision(START, "offload", "auto", "thread",
                    f"the policy runs on {device}: a call waits for the device, off the event loop")


def offload_start(cpu_s: float, line: float) -> Decision:
    """Where policy calls run under ``generation.offload="auto"``, from one measured inline call
    of ``cpu_s`` CPU seconds and the line ``generation.inline_below_s``."""
    if cpu_s > line:
        return Decision(START, "offload", "auto", "thread",
                        f"a policy call took {cpu_s * 1e3:.2f} ms of CPU on the event loop (over "
                        f"{line * 1e3:.1f} ms): in a thread the loop delivers sim results meanwhile")
    return Decision(START, "offload", "auto", "inline",
                    f"a policy call took {cpu_s * 1e3:.2f} ms of CPU (at most {line * 1e3:.1f} ms): "
                    "on the event loop it costs no thread hop")
