"""Run configuration: dataclasses, validation, file loading and ``key=value`` overrides.

Every bad value raises one :class:`ConfigError` naming the field, the value and what is
allowed::

    >>> from ebrl.config import RunConfig
    >>> RunConfig(num_envs=8, schedule="sync").schedule
    <Schedule.SYNC: 'sync'>
    >>> RunConfig(num_envs=0)
    Traceback (most recent call last):
    ...
    ebrl.config.ConfigError: num_envs=0: must be an integer >= 1
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def did_you_mean(key: str, known, n: int = 5, cutoff: float = 0.6) -> str:
    """``"; did you mean a, b?"`` for the close matches of ``key`` among ``known``, else ``""``."""
    close = difflib.get_close_matches(key, list(known), n=n, cutoff=cutoff)
    return f"; did you mean {', '.join(close)}?" if close else ""


class ConfigError(ValueError):
    """A configuration value is not allowed."""

    def __init__(self, name: str, value: Any, allowed: str):
        super().__init__(f"{name}={value!r}: {allowed}")
        self.field, self.value, self.allowed = name, value, allowed


class Schedule(enum.StrEnum):
    """How rollout and training are ordered. The three schedules share envs, policy and algorithm."""

    AUTO = "auto"  # the algorithm's preference (GRPO: sync), else async; resolved when the run starts
    ASYNC = "async"  # EBRL: every env its own coroutine, training overlaps rollout
    SYNC = "sync"  # all envs in lockstep; rollout, then train (gymnasium vector-env pattern)
    PIPELINED = "pipelined"  # env groups in lockstep, groups overlap; train after rollout


class SegmentCut(enum.StrEnum):
    """Where a rollout segment ends (besides the cuts that bound policy lag)."""

    AUTO = "auto"  # what the algorithm needs (GRPO: episode), else length; resolved when the run starts
    LENGTH = "length"  # after segment_len steps: episodes run across segments (PPO, V-trace)
    EPISODE = "episode"  # also at every episode end: one episode per segment, from its reset (GRPO)
    # whenever the learner is ready: it takes every step recorded since its last update, open
    # segments cut there, with no bound on policy lag (off-policy algorithms: SAC, RLPD, DSRL)
    STREAM = "stream"


class SimBackend(enum.StrEnum):
    """Where ``env.step`` runs."""

    AUTO = "auto"  # measured at start: inline if tiny, threads if the env releases the GIL, else processes
    INLINE = "inline"  # on the event loop thread (cheap envs, virtual time)
    THREAD = "thread"  # a pool of lane threads (simulators that release the GIL)
    PROCESS = "process"  # worker processes hosting the envs (GIL-bound Python envs)
    MIXED = "mixed"  # both: each env on lanes or in a worker, moved there by its measured step


class Offload(enum.StrEnum):
    """Where the policy's forward pass runs."""

    AUTO = "auto"  # inline while batches are cheap, a worker thread once they are not
    INLINE = "inline"
    THREAD = "thread"


class LearnerMode(enum.StrEnum):
    """Where ``algo.update`` runs."""

    AUTO = "auto"  # a process when the policy is on the CPU and there are >= 2 cores, else a thread
    THREAD = "thread"  # a thread of the run's process (GPU: kernels run asynchronously, little GIL)
    PROCESS = "process"  # a child process (CPU: keeps the event loop's GIL free of training)


class StreamMode(enum.StrEnum):
    """How generation and training share a GPU (``ebrl.runtime.resources.gpu``); a richer mode
    falls back to the next where the device or torch lacks it."""

    GREEN_CONTEXTS = "green-contexts"  # an SM split (green contexts), re-split by the controller
    PRIORITY_STREAMS = "priority-streams"  # two streams on every SM, generation's kernels first
    ONE_STREAM = "one-stream"  # one stream: the sides' kernels in submission order
    CPU = "cpu"  # no streams


class NonFinite(enum.StrEnum):
    """What to do with NaN or inf in an observation or reward."""

    RAISE = "raise"  # stop the run with an error naming env and step
    DROP = "drop"  # drop the env's open segment, reset the env, count the steps as dropped


def _coerce_enum(name: str, value: Any, kind: type[enum.Enum]) -> Any:
    if isinstance(value, kind):
        return value
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in kind)
        raise ConfigError(name, value, f"must be one of {allowed}") from None


def _check_int(name: str, value: Any, lo: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ConfigError(name, value, f"must be an integer >= {lo}" + (" or None" if optional else ""))


def _check_float(name: str, value: Any, lo: float, strict: bool = False, optional: bool = False) -> None:
    if optional and value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < lo or (strict and value == lo):
        rel = ">" if strict else ">="
        raise ConfigError(name, value, f"must be a finite number {rel} {lo}" + (" or None" if optional else ""))


@dataclass
class SimConfig:
    """The simulation pool."""

    backend: SimBackend = SimBackend.AUTO
    # lanes of the thread backend, fixed for the run; None: chosen by the AUTO probe (one per env for
    # envs that mostly wait, one per core for busy ones), else 2
    num_threads: int | None = None
    num_workers: int | None = None  # processes of the process backend; None = one per core
    # how child processes start (probe, sim workers, learner); None: fork while this process has no
    # graphics or GPU driver loaded, else a fork server (ebrl.runtime.children)
    start_method: str | None = None
    inline_below_s: float = 20e-6  # AUTO steps inline when a step costs less than this
    # a worker process holds finished envs at most this long before replying, and replies before
    # stepping an env known to take longer (or 3x its message-mates): a slow env never holds its
    # worker-mates' results. Smaller streams finer, at a block's CPU cost per reply.
    reply_hold_s: float = 0.002
    # envs per env_fn call: > 1 means env_fn(k) builds a gymnasium VectorEnv of that many envs
    # (a GPU simulator), stepped as one task (ebrl.runtime.sim.stepping)
    vector_size: int = 1

    def __post_init__(self) -> None:
        self.backend = _coerce_enum("sim.backend", self.backend, SimBackend)
        _check_int("sim.num_threads", self.num_threads, 1, optional=True)
        _check_int("sim.num_workers", self.num_workers, 1, optional=True)
        if self.start_method not in (None, "fork", "spawn", "forkserver"):
            raise ConfigError("sim.start_method", self.start_method, "must be 'fork', 'spawn', 'forkserver' or None")
        _check_float("sim.inline_below_s", self.inline_below_s, 0.0)
        _check_float("sim.reply_hold_s", self.reply_hold_s, 0.0)
        _check_int("sim.vector_size", self.vector_size, 1)


@dataclass
class GenerationConfig:
    """Dynamic batching of ``act()`` requests."""

    batch_target: int | None = None  # run a batch once this many requests wait; None = num_envs
    # cap on the adaptive wait (about one batch's duration) for a batch to fill; None: 2 ms, and
    # the resource controller may change it (an explicit value is kept)
    max_wait_s: float | None = None
    offload: Offload = Offload.AUTO
    # AUTO moves the policy to a thread once a call costs more CPU than this; the controller's
    # offload rule draws the same line, so neither undoes the other
    inline_below_s: float = 1e-3

    def __post_init__(self) -> None:
        _check_int("generation.batch_target", self.batch_target, 1, optional=True)
        _check_float("generation.max_wait_s", self.max_wait_s, 0.0, optional=True)
        self.offload = _coerce_enum("generation.offload", self.offload, Offload)
        _check_float("generation.inline_below_s", self.inline_below_s, 0.0)


DEFAULT_MAX_WAIT_S = 0.002


@dataclass
class ResourceConfig:
    """The resource manager: a live profile every epoch, and a controller that re-tunes the knobs
    left unset (``sim.num_threads``, ``sim.num_workers``, ``generation.batch_target``,
    ``generation.max_wait_s``) from it. Values set explicitly are never changed."""

    adapt: bool = True  # False: profile only, change nothing
    # seconds (loop time) a profile window lasts at least; it grows by this until it holds a few
    # env steps per env (slow decisions: a VLA on a busy GPU), at most MAX_WINDOW_EPOCHS times
    epoch_s: float = 1.0
    # sim lanes grow while envs wait for a lane longer than this fraction of their sim time
    lane_wait_above: float = 0.1
    # envs are re-placed on worker processes when the idlest worker is busy this fraction less
    # than the busiest (in the epoch's window)
    imbalance_above: float = 0.1
    # torch threads of the learner process; None: starts at torch_threads and the controller may
    # add threads while training holds envs back and cores idle (kept only if faster)
    learner_threads: int | None = None
    # pin the event loop, the learner and the sim workers to separate cores (os.sched_setaffinity)
    # when there are enough cores for it; kept only if it measures faster. False: never pin
    affinity: bool = True
    # how generation and training share a GPU. Priority streams are work-conserving: a side
    # that idles leaves every SM to the other. A green-context split does not (docs/gpu.md)
    gpu_streams: StreamMode = StreamMode.PRIORITY_STREAMS

    def __post_init__(self) -> None:
        self.gpu_streams = _coerce_enum("resources.gpu_streams", self.gpu_streams, StreamMode)
        if not isinstance(self.adapt, bool):
            raise ConfigError("resources.adapt", self.adapt, "must be true or false")
        _check_float("resources.epoch_s", self.epoch_s, 0.0, strict=True)
        _check_float("resources.lane_wait_above", self.lane_wait_above, 0.0)
        _check_float("resources.imbalance_above", self.imbalance_above, 0.0)
        _check_int("resources.learner_threads", self.learner_threads, 1, optional=True)
        if not isinstance(self.affinity, bool):
            raise ConfigError("resources.affinity", self.affinity, "must be true or false")


@dataclass
class FaultConfig:
    """How env failures and bad values are handled."""

    max_env_failures: int = 10  # more failures (raised or timed out) than this within the window stop the run
    failure_window_s: float = 60.0
    nonfinite: NonFinite = NonFinite.RAISE
    # a step longer than this is abandoned and its env replaced (thread lanes: a new lane; worker
    # processes: the worker is killed and respawned); None: wait for ever
    step_timeout_s: float | None = 60.0
    # building an env (env_fn) or resetting it, anywhere (the start-up probe, a lane, a worker, a
    # rebuild), and a worker's start: past this it is a fault of that env, handled as a hung step
    # (in the probe: run() ends with one error naming the env, the phase and this setting). A
    # LIBERO build or reset takes 6-9 s on 2 CPU cores; None: wait for ever
    build_timeout_s: float | None = 300.0
    # one learner update (algo.update with its publication) past this ends the run with a
    # LearnerError (the learner process is killed); None: no deadline (updates can be long)
    update_timeout_s: float | None = None
    # data-parallel jobs (ebrl.distributed): a collective waiting longer than this for another
    # rank fails, and the job ends (a dead rank ends it at once: its sockets close). Above
    # step_timeout_s, so a rank replacing a hung env is not taken for a hung rank
    collective_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        _check_int("faults.max_env_failures", self.max_env_failures, 0)
        _check_float("faults.collective_timeout_s", self.collective_timeout_s, 0.0, strict=True)
        _check_float("faults.step_timeout_s", self.step_timeout_s, 0.0, strict=True, optional=True)
        _check_float("faults.build_timeout_s", self.build_timeout_s, 0.0, strict=True, optional=True)
        _check_float("faults.update_timeout_s", self.update_timeout_s, 0.0, strict=True, optional=True)
        _check_float("faults.failure_window_s", self.failure_window_s, 0.0, strict=True)
        self.nonfinite = _coerce_enum("faults.nonfinite", self.nonfinite, NonFinite)


@dataclass
class RunConfig:
    """Everything ``ebrl.run`` needs besides the envs, the policy and the algorithm."""

    num_envs: int = 16
    segment_len: int = 64  # T: steps per env in one rollout segment
    total_env_steps: int = 100_000  # the run stops generating once this many steps are claimed
    # auto: the algorithm's preferred schedule (its run_needs; GRPO prefers sync), else async
    schedule: Schedule = Schedule.AUTO
    max_policy_lag: int = 1  # no trained sample is older than this many updates
    # auto: what the algorithm needs (GRPO: episode), or prefers (SAC: stream, under async with
    # max_policy_lag > 0), else length; an explicit value it cannot
    # train on is a ConfigError when the run starts (ebrl.algos.resolve_run_config)
    segment_cut: SegmentCut = SegmentCut.AUTO
    # envs in consecutive blocks of this size start every episode from the same seed (a reset
    # group: GRPO compares their returns); None: the algorithm's default (GRPO: 4), else each
    # env its own seeds
    reset_group: int | None = None
    batch_segments: int | None = None  # segments per update; None = num_envs
    num_groups: int = 2  # env groups of the pipelined schedule
    seed: int = 0
    torch_threads: int | None = 1  # torch intra-op threads in this process; None leaves torch's default
    learner: LearnerMode = LearnerMode.AUTO
    # where run() writes the run's files: history.jsonl and TensorBoard event files (per update),
    # result.json (at the end), checkpoint.pt (with checkpoint_every_s); None writes nothing.
    # `ebrl train` adds events.jsonl and spec.json to the same directory.
    log_dir: str | None = None
    checkpoint_every_s: float | None = None  # write log_dir/checkpoint.pt after an update, at most this often
    log_every_s: float = 5.0
    # mirror every TensorBoard scalar to Weights & Biases (the wandb extra; needs log_dir): online
    # where wandb has credentials (WANDB_API_KEY, `wandb login`), else offline; WANDB_MODE wins
    wandb: bool = False
    wandb_project: str = "ebrl"
    # evaluate the latest published weights this often (seconds) on an env of its own, without
    # pausing rollout (ebrl.evaluation); None: never
    eval_every_s: float | None = None
    eval_episodes: int = 10
    sim: SimConfig = field(default_factory=SimConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)
    resources: ResourceConfig = field(default_factory=ResourceConfig)

    def __post_init__(self) -> None:
        for name, sub in (("sim", SimConfig), ("generation", GenerationConfig), ("faults", FaultConfig),
                          ("resources", ResourceConfig)):
            value = getattr(self, name)
            if isinstance(value, dict):
                setattr(self, name, _build(sub, value, prefix=name + "."))
            elif not isinstance(value, sub):
                raise ConfigError(name, value, f"must be a {sub.__name__} or a table of its fields")
        _check_int("num_envs", self.num_envs, 1)
        _check_int("segment_len", self.segment_len, 1)
        _check_int("total_env_steps", self.total_env_steps, 1)
        self.schedule = _coerce_enum("schedule", self.schedule, Schedule)
        _check_int("max_policy_lag", self.max_policy_lag, 0)
        self.segment_cut = _coerce_enum("segment_cut", self.segment_cut, SegmentCut)
        _check_int("reset_group", self.reset_group, 1, optional=True)
        _check_int("batch_segments", self.batch_segments, 1, optional=True)
        _check_int("num_groups", self.num_groups, 1)
        vector = self.sim.vector_size
        if self.num_envs % vector:
            raise ConfigError("num_envs", self.num_envs, f"must be a multiple of sim.vector_size ({vector})")
        if self.schedule is Schedule.PIPELINED and self.num_groups > self.num_envs // vector:
            units = f"num_envs / sim.vector_size ({self.num_envs // vector})" if vector > 1 else f"num_envs ({self.num_envs})"
            raise ConfigError("num_groups", self.num_groups, f"must be <= {units}")
        if self.reset_group is not None:
            if self.num_envs % self.reset_group:
                raise ConfigError("reset_group", self.reset_group, f"must divide num_envs ({self.num_envs})")
            if vector > 1:
                raise ConfigError("reset_group", self.reset_group,
                                  "needs sim.vector_size=1 (a vector env's autoresets cannot be seeded per env)")
        _check_int("seed", self.seed, 0)
        _check_int("torch_threads", self.torch_threads, 1, optional=True)
        self.learner = _coerce_enum("learner", self.learner, LearnerMode)
        _check_float("log_every_s", self.log_every_s, 0.0, strict=True)
        if not isinstance(self.wandb, bool):
            raise ConfigError("wandb", self.wandb, "must be true or false")
        if self.wandb and self.log_dir is None:
            raise ConfigError("wandb", self.wandb, "needs log_dir: the wandb run's files go there")
        if not isinstance(self.wandb_project, str) or not self.wandb_project:
            raise ConfigError("wandb_project", self.wandb_project, "must be a non-empty string")
        if self.eval_every_s is not None:
            _check_float("eval_every_s", self.eval_every_s, 0.0, strict=True)
            if self.sim.vector_size > 1:
                raise ConfigError("eval_every_s", self.eval_every_s, "needs sim.vector_size=1 (it evaluates "
                                  "in one env of its own)")
        _check_int("eval_episodes", self.eval_episodes, 1)
        if self.checkpoint_every_s is not None:
            _check_float("checkpoint_every_s", self.checkpoint_every_s, 0.0)
            if self.log_dir is None:
                raise ConfigError("checkpoint_every_s", self.checkpoint_every_s, "needs log_dir: checkpoints go there")

    @property
    def segments_per_batch(self) -> int:
        return self.batch_segments or self.num_envs

    @property
    def gen_batch_target(self) -> int:
        return self.generation.batch_target or self.num_envs

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunConfig":
        return _build(cls, data)

    def with_overrides(self, overrides: list[str] | dict[str, Any]) -> "RunConfig":
        """A copy with ``key=value`` overrides applied; dotted keys reach nested tables."""
        data = self.to_dict()
        items = overrides.items() if isinstance(overrides, dict) else (parse_setting(o) for o in overrides)
        for key, value in items:
            _set_path(data, key, value)
        return RunConfig.from_dict(data)


def _build(kind: type, data: dict[str, Any], prefix: str = "") -> Any:
    names = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(prefix + unknown[0], data[unknown[0]], f"unknown field; allowed: {', '.join(sorted(names))}")
    return kind(**data)


def parse_setting(item: str, flag: str = "--set", example: str = "num_envs=32") -> tuple[str, Any]:
    """``key=value`` from a command line flag, the value in TOML's syntax (bare words are strings).

    >>> parse_setting("run.num_envs=32")
    ('run.num_envs', 32)
    """
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(flag, item, f"must look like key=value, e.g. {example}")
    return key.strip(), _parse_value(raw.strip())


def _parse_value(raw: str) -> Any:
    """TOML's value syntax, with bare words taken as strings: ``32``, ``1e-3``, ``true``, ``async``."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _set_path(data: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = data
    for i, part in enumerate(parents):
        if not isinstance(node.get(part), dict):
            raise ConfigError(".".join(parents[: i + 1]), node.get(part), "is not a table of fields")
        node = node[part]
    if leaf not in node:
        raise ConfigError(key, value, f"unknown field; allowed: {', '.join(sorted(node))}")
    node[leaf] = value


def load_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML (or, with PyYAML installed, YAML) file into a plain dict."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("config", str(path), "no such file")
    if path.suffix == ".toml":
        return tomllib.loads(path.read_text())
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError("config", str(path), "YAML needs PyYAML: pip install pyyaml (or use TOML)") from None
        return yaml.safe_load(path.read_text()) or {}
    raise ConfigError("config", str(path), "must end in .toml, .yaml or .yml")
