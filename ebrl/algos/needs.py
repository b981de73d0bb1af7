"""What an algorithm needs of the run, and the one function that applies it to a RunConfig.

An algorithm declares its needs as ``run_needs`` (a :class:`RunNeeds`, an attribute or a
property); one that declares nothing (PPO, DecoupledPPO, VTrace, a user's class) needs
nothing. :func:`resolve_run_config` fills the config's ``auto`` fields (and
``reset_group=None``) from those needs and refuses settings that contradict them, naming the
field. ``ebrl.run`` calls it before it builds anything, and ``ebrl train`` through the same
function, so a script gets what the command line gets::

    >>> from ebrl.algos import GRPO, PPO, resolve_run_config
    >>> from ebrl.config import RunConfig
    >>> cfg = resolve_run_config(RunConfig(num_envs=8, segment_len=30), GRPO(), time_limit=50)
    >>> cfg.schedule.value, cfg.segment_cut.value, cfg.reset_group, cfg.segment_len
    ('sync', 'episode', 4, 50)
    >>> cfg = resolve_run_config(RunConfig(num_envs=8), PPO(), time_limit=50)
    >>> cfg.schedule.value, cfg.segment_cut.value, cfg.reset_group, cfg.segment_len
    ('async', 'length', None, 64)
    >>> resolve_run_config(RunConfig(num_envs=8, segment_cut="length"), GRPO())
    Traceback (most recent call last):
    ...
    ebrl.config.ConfigError: segment_cut='length': GRPO needs 'episode' (it compares whole episodes from their resets)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ebrl.config import ConfigError, RunConfig, Schedule, SegmentCut
from ebrl.telemetry.logging import get_logger

log = get_logger("ebrl.algos")


@dataclass(frozen=True)
class RunNeeds:
    """What an algorithm needs of the runtime. The defaults need nothing."""

    segment_cut: SegmentCut | None = None  # the cut it needs; None: any (auto gives 'length')
    reset_group: int | None = None  # envs per reset group when the run sets none; None: needs no groups
    min_reset_group: int = 1  # the smallest reset group it can learn from
    # segments at least as long as the env's time limit: an episode cut in two is lost to it
    whole_episodes: bool = False
    schedule: Schedule | None = None  # what schedule='auto' runs; None: async
    # it can train on a stream (segment_cut='stream': every step recorded since its last update,
    # whatever its policy lag), and segment_cut='auto' gives one under async with lag > 0
    stream: bool = False
    why: str = ""  # why, for the errors: "it compares whole episodes from their resets"

    def __post_init__(self) -> None:
        if self.segment_cut is SegmentCut.AUTO or self.schedule is Schedule.AUTO:
            raise ValueError("RunNeeds names a concrete segment_cut and schedule, not 'auto'")
        if self.stream and self.segment_cut is not None:
            raise ValueError("RunNeeds(stream=True) needs no segment_cut: a stream cuts segments at each update")
        if self.reset_group is not None and self.reset_group < self.min_reset_group:
            raise ValueError(f"RunNeeds(reset_group={self.reset_group}) is below "
                             f"min_reset_group={self.min_reset_group}")


NO_NEEDS = RunNeeds()


def run_needs(algo: object) -> RunNeeds:
    """``algo.run_needs``, or :data:`NO_NEEDS` for an algorithm that declares none."""
    needs = getattr(algo, "run_needs", None)
    if needs is None:
        return NO_NEEDS
    if not isinstance(needs, RunNeeds):
        raise ConfigError("algo", type(algo).__name__, f"run_needs must be an ebrl.algos.RunNeeds, got {needs!r}")
    return needs


def resolve_run_config(cfg: RunConfig, algo: object, time_limit: int | None = None) -> RunConfig:
    """A copy of ``cfg`` with every ``auto`` filled from ``algo``'s :class:`RunNeeds`.

    ``schedule="auto"``: the algorithm's preference, else async. ``segment_cut="auto"``: what
    it needs, else a stream for one that can train on it (under async, ``max_policy_lag > 0``),
    else length. ``reset_group=None``: its default group (the divisor of
    ``num_envs`` nearest to it, at least its minimum), else none. With ``time_limit`` (env
    0's ``spec.max_episode_steps``), an algorithm that needs whole episodes gets
    ``segment_len`` raised to it (logged). A setting the algorithm cannot train on raises a
    :class:`~ebrl.config.ConfigError` naming the field. Resolving a resolved config changes
    nothing, so it can be called again once the time limit is known.
    """
    needs, name = run_needs(algo), type(algo).__name__
    why = f" ({needs.why})" if needs.why else ""
    changes: dict = {}
    schedule = cfg.schedule
    if schedule is Schedule.AUTO:
        schedule = changes["schedule"] = needs.schedule or Schedule.ASYNC
    if cfg.segment_cut is SegmentCut.AUTO:
        streams = needs.stream and schedule is Schedule.ASYNC and cfg.max_policy_lag > 0
        changes["segment_cut"] = needs.segment_cut or (SegmentCut.STREAM if streams else SegmentCut.LENGTH)
    elif needs.segment_cut is not None and cfg.segment_cut is not needs.segment_cut:
        raise ConfigError("segment_cut", cfg.segment_cut.value, f"{name} needs {needs.segment_cut.value!r}{why}")
    elif cfg.segment_cut is SegmentCut.STREAM:
        if not needs.stream:
            raise ConfigError("segment_cut", "stream", f"{name} trains on segments whose policy lag is bounded; a "
                              "stream is for algorithms that declare RunNeeds(stream=True) (SAC, RLPD)")
        if schedule is not Schedule.ASYNC or cfg.max_policy_lag == 0:
            raise ConfigError("segment_cut", "stream", "needs schedule='async' and max_policy_lag > 0 (a stream "
                              "updates while envs step; the lockstep schedules and lag 0 pause them for each update)")
    if needs.reset_group is not None:
        if cfg.sim.vector_size > 1:  # RunConfig refuses an explicit reset_group there; this is the implied one
            raise ConfigError("sim.vector_size", cfg.sim.vector_size,
                              f"{name} needs envs in reset groups{why}, which need sim.vector_size=1 "
                              "(a vector env's autoresets cannot be seeded per env)")
        if cfg.reset_group is None:
            changes["reset_group"] = _group_size(cfg.num_envs, needs, name, why)
        elif cfg.reset_group < needs.min_reset_group:
            raise ConfigError("reset_group", cfg.reset_group,
                              f"{name} needs reset groups of at least {needs.min_reset_group} envs{why}")
    if needs.whole_episodes and time_limit is not None and cfg.segment_len < time_limit:
        log.info("segment_len_raised", algo=name, segment_len=int(time_limit), was=cfg.segment_len,
                 why="an episode longer than its segment is cut in two, and neither part can be used")
        changes["segment_len"] = int(time_limit)
    return dataclasses.replace(cfg, **changes) if changes else cfg


def _group_size(num_envs: int, needs: RunNeeds, name: str, why: str) -> int:
    """The algorithm's default group size if it divides ``num_envs``, else the divisor nearest
    to it (the smaller on a tie) of at least ``min_reset_group``."""
    want = needs.reset_group
    sizes = [k for k in range(max(needs.min_reset_group, 1), num_envs + 1) if num_envs % k == 0]
    if not sizes:
        raise ConfigError("num_envs", num_envs, f"{name} needs reset groups of at least {needs.min_reset_group} "
                          f"envs{why}: run at least that many envs")
    size = min(sizes, key=lambda k: (abs(k - want), k))
    if size != want:
        log.info("reset_group_chosen", algo=name, reset_group=size, default=want, num_envs=num_envs)
    return size
