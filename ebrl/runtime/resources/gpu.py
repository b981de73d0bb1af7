"""Generation and training on separate CUDA streams, on green contexts where they work.

:meth:`GpuStreams.create` tries, richest first, and records in ``fallback_reason`` why a richer
mode was not used; it never raises, and on a host without CUDA it is mode ``cpu``:

1. ``green-contexts``: ``torch.cuda.GreenContext.create(num_sms=..., device_id=...)`` and a
   stream from each context's ``.Stream()`` (torch 2.13: a beta API; ``create`` raises
   ``RuntimeError`` when torch was built without green contexts, as the CPU wheels are, when
   torch or the driver is older than CUDA 12.8, or when ``num_sms`` is out of range);
2. ``priority-streams``: two ``torch.cuda.Stream`` objects, generation at the highest priority of
   ``torch.cuda.Stream.priority_range()`` (lower number = higher priority, so the minimum of
   the pair), training at the lowest;
3. ``one-stream``: one stream for both (ordered, no overlap);
4. ``cpu``: no streams; the context managers do nothing and :meth:`~GpuStreams.publish` is None.

Layouts in ``green-contexts`` mode (``layout=``): ``"both"`` puts generation on a context of
``split.generation`` SMs and training on one of ``split.training`` SMs; ``"training"`` confines
training alone and runs generation on a high-priority stream of the whole device.

Overlapping contexts. torch creates every green context by splitting the *whole* device's SM
resource again (``cuDevSmResourceSplitByCount`` with one group; the remainder is dropped), so two
``create`` calls are not one disjoint partition: the driver picks both sets, may put them on the
same SMs, and reports observe it picking the lowest SMs each time (generation's set then lies
inside training's, and ``total - split.training`` SMs run neither). This code does
nothing about it: torch offers no call that could. ``split`` is therefore an upper bound on the
SMs each side may use, not an exclusive partition. Only the ``"training"`` layout keeps a
guarantee whatever the placement: at least ``split.generation`` SMs never run training kernels,
and generation may use them.

Weights. :meth:`~GpuStreams.publish` records a CUDA event on the training stream (call it
inside :meth:`~GpuStreams.training`, after the snapshot copy of the new weights is enqueued);
:meth:`~GpuStreams.wait_published` makes the generation stream wait for it before the new
weights are read. The event orders the snapshot, nothing else: the snapshot must be a copy,
kept alive (or ``record_stream``-ed) until generation is done with it. Not yet run on a GPU:
that an event made with the primary context current records on a green context's stream (CUDA
asks for one context) is unverified; ``ebrl bench gpu-split`` exercises it.

SM split (:func:`plan_sm_split`, pure): the SMs split in proportion to the SM-seconds each side
used in the last window, so that neither waits on the other. GPU telemetry (SM utilisation,
memory) is sampled by :class:`ebrl.telemetry.system.SystemSampler` (pynvml); nothing here reads it.

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
    """A green context's SM count must be a multiple of this (and at least this), after CUDA's
    guideline for ``cuDevSmResourceSplitByCount``: compute capability 9.0+ 8; 8.x 4 (CUDA 12: at
    least 4, a multiple of 2; CUDA 13.3: a multiple of 2); 7.x 2; older 1. torch checks no compute
    capability (only CUDA and driver >= 12.8); what the driver rejects, ``create`` falls back from."""
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
    g, floor, usable = _bounds(total_sms, granularity, min_sms)
    quarter = math.floor(usable / 4 / g + 0.5) * g
    return clamp_split(total_sms, quarter, g, min_sms, "default start: a quarter of the SMs to generation")


def plan_sm_split(total_sms: int, gen_sms_now: int, gen_busy: float, train_busy: float, granularity: int = 8,
                  min_sms: int | None = None) -> SmSplit:
    """The next split of ``total_sms``, from how busy each side was on its SMs in a window
    (``gen_busy``, ``train_busy``: the share of the window its calls ran, 0 to 1).

    Each side's demand is the SM-seconds it used, ``busy * sms``; the SMs are split in
    proportion to the demands. When the device is the bottleneck this makes both sides take
    equally long for their work, so neither waits on the other (a side that waits shows up as
    idle, and gives SMs up). A move is at most a doubling or a halving of generation's SMs, and
    a wanted change of under one granule is none (hysteresis).

    - no split yet (``gen_sms_now <= 0``): :func:`start_split`;
    - training did not run in the window: hold (the first rollout has nothing to train on yet;
      later, a learner waiting for data shows as training busy under 1 beside generation).
      Generation that did not run (the envs held back by an update, or the run's last update)
      used no SMs: its share halves at each such move, down to one granule.

    Both sides are multiples of ``granularity`` and at least ``min_sms`` (default one granule);
    raises ``ValueError`` when ``total_sms`` cannot hold that.
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
        """The richest mode up to ``max_mode`` that works on ``device`` (default: the current
        one). ``gen_sms``: generation's SMs for green contexts (default: :func:`start_split`). ``torch_module``: a stand-in for ``torch`` (tests)."""
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
        reasons = []
        if RICHNESS.index(max_mode) >= RICHNESS.index(StreamMode.GREEN_CONTEXTS):
            why = self._try_green(gen_sms)
            if why is None:
                return self
            reasons.append(why)
        if RICHNESS.index(max_mode) >= RICHNESS.index(StreamMode.PRIORITY_STREAMS):
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

    def _green(self, split: SmSplit) -> tuple[Any, Any, tuple]:
        """(generation stream, training stream, contexts) for ``split``; raises what torch raises."""
        make = self._torch.cuda.GreenContext.create
        train_ctx = make(num_sms=split.training, device_id=self.device)
        if self.layout == "training":
            gen_stream = self._priority_pair()[0]
            return gen_stream, train_ctx.Stream(), (train_ctx,)
        gen_ctx = make(num_sms=split.generation, device_id=self.device)
        return gen_ctx.Stream(), train_ctx.Stream(), (gen_ctx, train_ctx)

    def _try_green(self, gen_sms: int | None) -> str | None:
        """Switch to green contexts; None on success, else why not."""
        if getattr(self._torch.cuda, "GreenContext", None) is None:
            return "torch has no torch.cuda.GreenContext"
        try:
            split = (start_split(self.total_sms, self.granularity) if gen_sms is None
                     else clamp_split(self.total_sms, gen_sms, self.granularity))
        except ValueError as exc:
            return f"no green-context split: {exc}"
        try:
            gen_stream, train_stream, contexts = self._green(split)
        except Exception as exc:  # noqa: BLE001 (RuntimeError, or whatever the driver raises)
            return f"GreenContext.create raised {type(exc).__name__}: {exc}"
        self.mode, self.split, self._contexts = StreamMode.GREEN_CONTEXTS, split, contexts
        self.generation_stream, self.training_stream = gen_stream, train_stream
        return None

    def _enter(self, stream: Any):
        if stream is None:
            return contextlib.nullcontext()
        return self._torch.cuda.stream(stream)

    def generation(self):
        """Context manager: the calling thread's CUDA work goes to the generation stream."""
        return self._enter(self.generation_stream)

    def training(self):
        """Context manager: the calling thread's CUDA work goes to the training stream."""
        return self._enter(self.training_stream)

    def publish(self) -> Any:
        """A CUDA event recorded on the training stream (after the weight snapshot); None on CPU."""
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
        try:
            gen_stream, train_stream, contexts = self._green(split)
        except Exception as exc:  # noqa: BLE001
            self.fallback_reason = f"resplit to {split.generation} SMs: GreenContext.create raised " \
                                   f"{type(exc).__name__}: {exc}"
            return False
        self.generation_stream, self.training_stream, self._contexts = gen_stream, train_stream, contexts
        self.split = split
        return True

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
