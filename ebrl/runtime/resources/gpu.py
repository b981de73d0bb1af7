"""Generation and training on separate CUDA streams, on green contexts where they work.

:meth:`GpuStreams.create` tries ``green-contexts``, ``priority-streams``, ``one-stream`` and
``cpu``, richest first, and records in ``fallback_reason`` why a richer mode was not used; it
never raises. docs/gpu.md describes the modes, the layouts, and why a green-context ``split`` is
an upper bound on each side's SMs, not an exclusive partition (torch splits the whole device
again for each context, and the driver may place both on the same SMs).
:meth:`~GpuStreams.publish` and :meth:`~GpuStreams.wait_published` order a weight snapshot
between the streams; :func:`plan_sm_split` (pure) splits the SMs in proportion to the
SM-seconds each side used. GPU telemetry is :class:`ebrl.telemetry.system.SystemSampler`'s.

    >>> s = start_split(132)  # H100/H200: 132 SMs
    >>> s.generation, s.training
    (32, 96)
    >>> s = plan_sm_split(132, 32, gen_busy=0.5, train_busy=1.0)  # training is the bottleneck
    >>> s.generation, s.training
    (16, 112)
    >>> from types import SimpleNamespace
    >>> streams = GpuStreams.create(torch_module=SimpleNamespace(cuda=SimpleNamespace(is_available=lambda: False)))
    >>> streams.mode, streams.fallback_reason, streams.publish()
    (<StreamMode.CPU: 'cpu'>, 'CUDA is not available', None)
    >>> with streams.generation():
    ...     pass
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, replace
from typing import Any

from ebrl.config import StreamMode

LAYOUTS = ("both", "training")
RICHNESS = (StreamMode.CPU, StreamMode.ONE_STREAM, StreamMode.PRIORITY_STREAMS, StreamMode.GREEN_CONTEXTS)


@dataclass(frozen=True)
class SmSplit:
    """SMs for each side (multiples of the granularity) and why."""

    generation: int
    training: int
    reason: str


def sm_granularity(major: int, minor: int) -> int:
    """A green context's SM count must be a multiple of this (and at least this): CUDA's guideline
    for ``cuDevSmResourceSplitByCount`` by compute capability; what the driver rejects, ``create``
    falls back from."""
    del minor  # no rule depends on it so far
    return 8 if major >= 9 else {8: 4, 7: 2}.get(major, 1)


def _round_up(x: float, g: int) -> int:
    return math.ceil(x / g - 1e-9) * g


def _bounds(total_sms: int, granularity: int, min_sms: int | None) -> tuple[int, int, int]:
    """(granularity, least SMs per side, SMs usable: total rounded down to the granularity)."""
    g = max(1, int(granularity))
    floor = _round_up(max(min_sms or g, g), g)
    usable = total_sms // g * g
    if usable < 2 * floor:
        raise ValueError(f"{total_sms} SMs cannot hold two sides of at least {floor} SMs (granularity {g})")
    return g, floor, usable


def clamp_split(total_sms: int, gen_sms: int, granularity: int = 8, min_sms: int | None = None,
                reason: str = "requested") -> SmSplit:
    """``gen_sms`` rounded up to the granularity and kept in range; training gets the rest
    (rounded down: ``total % granularity`` SMs go to neither)."""
    g, floor, usable = _bounds(total_sms, granularity, min_sms)
    gen = min(max(_round_up(gen_sms, g), floor), usable - floor)
    return SmSplit(gen, usable - gen, reason)


def start_split(total_sms: int, granularity: int = 8, min_sms: int | None = None) -> SmSplit:
    """The split before anything is measured: a quarter of the SMs to generation (in granules,
    rounded half up), training the rest."""
    g, _, usable = _bounds(total_sms, granularity, min_sms)
    quarter = math.floor(usable / 4 / g + 0.5) * g
    return clamp_split(total_sms, quarter, g, min_sms, "default start: a quarter of the SMs to generation")


def plan_sm_split(total_sms: int, gen_sms_now: int, gen_busy: float, train_busy: float, granularity: int = 8,
                  min_sms: int | None = None) -> SmSplit:
    """The next split of ``total_sms``, from the share of a window each side's calls ran (0 to 1).

    The SMs split in proportion to the SM-seconds each side used (``busy * sms``): on a saturated
    device both sides then take equally long, so neither waits on the other. A move is at most a
    doubling or a halving of generation's SMs, and a wanted change under one granule is none.
    Without a split yet it is :func:`start_split`; in a window where training did not run (the
    first rollout) it holds. Raises ``ValueError`` when ``total_sms`` cannot hold two sides.
    """
    if gen_sms_now <= 0:
        return start_split(total_sms, granularity, min_sms)
    g, floor, usable = _bounds(total_sms, granularity, min_sms)
    now = clamp_split(total_sms, gen_sms_now, g, min_sms)
    if not train_busy > 0:
        return replace(now, reason="training did not run in the window: holding")
    gen_demand, train_demand = gen_busy * now.generation, train_busy * now.training
    raw = usable * gen_demand / (gen_demand + train_demand)
    want = min(max(raw, now.generation / 2), now.generation * 2)
    gen = math.floor(want / g + 0.5) * g if abs(want - now.generation) >= g else now.generation  # hysteresis
    why = (f"generation used {gen_demand:.1f} SMs on average (busy {gen_busy:.0%} of {now.generation}), training "
           f"{train_demand:.1f} ({train_busy:.0%} of {now.training})")
    split = clamp_split(total_sms, gen, g, min_sms, why)
    if split.generation == now.generation:
        return replace(split, reason=why + ": holding")
    bound = (" (at the maximum)" if split.generation == usable - floor and raw > usable - floor
             else " (at the minimum)" if split.generation == floor and raw < floor else "")
    return replace(split, reason=f"{why}: split in proportion{bound}")


def _device_index(cuda: Any, device: Any) -> int:
    if isinstance(device, int):
        return device
    index = getattr(device, "index", None)
    if isinstance(device, str) and ":" in device:
        index = int(device.rpartition(":")[2])
    if index is None:
        index = cuda.current_device() if hasattr(cuda, "current_device") else 0
    return int(index)


@dataclass
class GpuStreams:
    """The streams generation and training run on; build with :meth:`create`."""

    mode: StreamMode
    generation_stream: Any = None
    training_stream: Any = None
    total_sms: int = 0
    split: SmSplit | None = None
    fallback_reason: str = ""
    device: int | None = None
    granularity: int = 0
    layout: str = "both"
    priorities: tuple[int, int] | None = None  # (generation, training) where chosen here
    _torch: Any = field(default=None, repr=False)
    _contexts: tuple = field(default=(), repr=False)  # the green contexts, kept alive

    @classmethod
    def create(cls, device: Any = None, gen_sms: int | None = None, torch_module: Any = None, *,
               max_mode: StreamMode | str = StreamMode.GREEN_CONTEXTS, layout: str = "both") -> GpuStreams:
        """The richest mode up to ``max_mode`` that works on ``device`` (default: the current one).
        ``gen_sms``: generation's SMs for green contexts (default: :func:`start_split`);
        ``torch_module``: a stand-in for ``torch`` (tests)."""
        max_mode = StreamMode(max_mode)
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if max_mode is StreamMode.CPU:
            return cls(StreamMode.CPU, fallback_reason="cpu mode requested", layout=layout)
        torch = torch_module
        if torch is None:
            try:
                import torch
            except ImportError:
                return cls(StreamMode.CPU, fallback_reason="torch is not installed", layout=layout)
        cuda = torch.cuda
        if not cuda.is_available():  # False, not an error, without a driver or with a CPU build
            return cls(StreamMode.CPU, fallback_reason="CUDA is not available", layout=layout, _torch=torch)
        index = _device_index(cuda, device)
        props = cuda.get_device_properties(index)
        self = cls(StreamMode.ONE_STREAM, total_sms=int(props.multi_processor_count), device=index,
                   granularity=sm_granularity(props.major, props.minor), layout=layout, _torch=torch)
        reasons, allowed = [], RICHNESS[:RICHNESS.index(max_mode) + 1]
        if StreamMode.GREEN_CONTEXTS in allowed:
            why = self._try_green(gen_sms)
            if why is None:
                return self
            reasons.append(why)
        if StreamMode.PRIORITY_STREAMS in allowed:
            try:
                self.generation_stream, self.training_stream = self._priority_pair()
                self.mode = StreamMode.PRIORITY_STREAMS
                self.fallback_reason = "; ".join(reasons)
                return self
            except Exception as exc:  # noqa: BLE001 (fall back, never raise)
                reasons.append(f"priority streams failed: {type(exc).__name__}: {exc}")
        else:
            reasons.append(f"{max_mode} mode requested")
        try:
            self.generation_stream = self.training_stream = cuda.Stream(device=index)
        except Exception as exc:  # noqa: BLE001
            reasons.append(f"torch.cuda.Stream raised {type(exc).__name__}: {exc}")
            self.mode, self.generation_stream, self.training_stream = StreamMode.CPU, None, None
        self.fallback_reason = "; ".join(reasons)
        return self

    def _priority_pair(self) -> tuple[Any, Any]:
        cuda = self._torch.cuda
        pair = tuple(cuda.Stream.priority_range())
        high, low = min(pair), max(pair)  # lower number = higher priority
        self.priorities = (high, low)
        return cuda.Stream(device=self.device, priority=high), cuda.Stream(device=self.device, priority=low)

    def _switch(self, split: SmSplit) -> str | None:
        """Green contexts for ``split`` and streams on them; None on success, else why not (then
        nothing changed)."""
        make = self._torch.cuda.GreenContext.create
        try:
            train_ctx = make(num_sms=split.training, device_id=self.device)
            if self.layout == "training":  # generation on a high-priority stream of the whole device
                contexts, gen_stream = (train_ctx,), self._priority_pair()[0]
            else:
                gen_ctx = make(num_sms=split.generation, device_id=self.device)
                contexts, gen_stream = (gen_ctx, train_ctx), gen_ctx.Stream()
            train_stream = train_ctx.Stream()
        except Exception as exc:  # noqa: BLE001 (RuntimeError, or whatever the driver raises)
            return f"GreenContext.create raised {type(exc).__name__}: {exc}"
        self.mode, self.split, self._contexts = StreamMode.GREEN_CONTEXTS, split, contexts
        self.generation_stream, self.training_stream = gen_stream, train_stream
        return None

    def _try_green(self, gen_sms: int | None) -> str | None:
        """Switch to green contexts; None on success, else why not."""
        if getattr(self._torch.cuda, "GreenContext", None) is None:
            return "torch has no torch.cuda.GreenContext"
        try:
            split = (start_split(self.total_sms, self.granularity) if gen_sms is None
                     else clamp_split(self.total_sms, gen_sms, self.granularity))
        except ValueError as exc:
            return f"no green-context split: {exc}"
        return self._switch(split)

    def _enter(self, stream: Any):
        return contextlib.nullcontext() if stream is None else self._torch.cuda.stream(stream)

    def generation(self):
        """Context manager: the calling thread's CUDA work goes to the generation stream."""
        return self._enter(self.generation_stream)

    def training(self):
        """Context manager: the calling thread's CUDA work goes to the training stream."""
        return self._enter(self.training_stream)

    def publish(self) -> Any:
        """A CUDA event recorded on the training stream (after the weight snapshot); None on CPU. It
        orders the snapshot only: that must be a copy, kept alive until generation has read it."""
        if self.training_stream is None:
            return None
        event = self._torch.cuda.Event()
        event.record(self.training_stream)
        return event

    def wait_published(self, event: Any) -> None:
        """Generation's later work waits for ``event`` on the GPU (the host does not block)."""
        if event is not None and self.generation_stream is not None:
            self.generation_stream.wait_event(event)

    def resplit(self, gen_sms: int) -> bool:
        """New green contexts for generation's ``gen_sms`` (green-contexts mode only); whether
        the split changed. Waits for both streams' work first: call it outside
        :meth:`generation` and :meth:`training`. When creating fails the old split stays."""
        if self.mode is not StreamMode.GREEN_CONTEXTS:
            return False
        split = clamp_split(self.total_sms, gen_sms, self.granularity, reason="resplit")
        if self.split is not None and split.generation == self.split.generation:
            return False
        for stream in (self.generation_stream, self.training_stream):
            stream.synchronize()
        why = self._switch(split)
        if why is not None:
            self.fallback_reason = f"resplit to {split.generation} SMs: {why}"
        return why is None

    def describe(self) -> dict:
        """What the logs need: mode, device, SMs, split, priorities, why not richer."""
        split = self.split
        return {"mode": str(self.mode), "device": self.device, "total_sms": self.total_sms,
                "granularity": self.granularity,
                "layout": self.layout if self.mode is StreamMode.GREEN_CONTEXTS else None,
                "gen_sms": split and split.generation, "train_sms": split and split.training,
                "split_reason": split and split.reason,
                "priorities": list(self.priorities) if self.priorities else None,
                "fallback_reason": self.fallback_reason}
