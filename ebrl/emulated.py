"""An emulated accelerator: a VLA's generation and training take device time from a latency
model calibrated from published figures, while a small model on the CPU computes their outputs.

The paper's regime is simulation on CPU cores beside a GPU that generates and trains. Without a
GPU, :class:`EmulatedPolicy` wraps a small policy (its actions, log-probs, values and gradients
are real, so shapes, publication and accounting stay real) and makes each call wait for the
time the modelled device would take: the calling thread sleeps until the device is done, as a
host thread waits on a CUDA synchronise, leaving the CPU to the simulators.

The model (:class:`DeviceProfile`), per call:

- a policy call of ``B`` rows: ``act_fixed_s + act_per_row_s * B / share``, the line through a
  published batch curve; for a flow policy the denoising steps' part scales with their number
  (their published share of a call);
- a training step of ``b`` samples (one minibatch's forward, backward and optimiser step):
  ``train_fixed_s + train_per_sample_s * b / share``, the line through published samples/s;
- ``share``: the SMs of the call's side over the device's (1 on one shared stream). The per-row
  part fills the SMs it is given and scales with 1/share; the fixed part is latency-bound
  (small kernels, launches, memory traffic) and does not.

Calls queue the way kernels queue on streams (:class:`EmulatedDevice`), in the run's
``resources.gpu_streams`` mode: on two priority streams (the default) each side has its own
queue on every SM and generation's kernels go first; on one stream generation and training run
one after another in submission order; with an SM split (green contexts, see
:mod:`ebrl.runtime.resources.gpu`) each side runs on its share, concurrently. The device reports busy time and
utilisation through an NVML-shaped facade (:meth:`EmulatedDevice.nvml`), which
:class:`ebrl.telemetry.system.SystemSampler` reads as it reads a GPU, and the controller splits
its SMs through :class:`EmulatedStreams` as it splits a GPU's.

What it cannot show: memory-bandwidth and cache contention between the two sides (on priority
streams too: a real GPU's concurrent kernels slow each other), how long a high-priority kernel
waits for the other side's running blocks, kernel-launch overhead on the host, the driver's
placement of SMs (a real split is an upper bound, see
:mod:`ebrl.runtime.resources.gpu`), and host-to-device copies. The figures and their sources
are in ``docs/gpu.md``.

    >>> device = EmulatedDevice(PROFILES["pi0-h200"], clock=lambda: 0.0)  # a clock standing at 0
    >>> round(device.profile.act_s(16) * 1e3, 1)      # ms: π0, batch 16, 10 denoising steps, all SMs
    175.4
    >>> call = device.submit("generation", device.profile.act_s(1))
    >>> round(call.end * 1e3, 1), device.busy_s["generation"] == device.profile.act_s(1)
    (24.7, True)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import nn

from ebrl.runtime.resources.gpu import GpuStreams, SmSplit, StreamMode, clamp_split, start_split
from ebrl.spaces import batch_size

SIDES = ("generation", "training")
MODES = (StreamMode.PRIORITY_STREAMS, StreamMode.GREEN_CONTEXTS, StreamMode.ONE_STREAM)


def fit_line(points: dict[float, float]) -> tuple[float, float]:
    """``(intercept, slope)`` of the least-squares line through ``{x: y}``, both at least 0.

        >>> fit_line({1: 3.0, 2: 5.0, 4: 9.0})
        (1.0, 2.0)
    """
    x = np.array(list(points), float)
    y = np.array(list(points.values()), float)
    slope = float(np.sum((x - x.mean()) * (y - y.mean())) / np.sum((x - x.mean()) ** 2))
    return max(0.0, float(y.mean() - slope * x.mean())), max(0.0, slope)


# ---------------------------------------------------------------- published figures (docs/gpu.md)

# π0 (3.5B: SigLIP, Gemma 2B, a 300M action expert), three 224px views, 10 denoising steps, BF16,
# torch.compile and CUDA graphs, one H200: milliseconds per call against the batch size.
# github.com/sunxxuns/openpi-1, README.md at eb1e501, "Batch size scaling (latency)".
PI0_H200_MS = {1: 25.3, 2: 34.4, 4: 53.4, 8: 94.1, 16: 175.1, 32: 340.5, 64: 655.9}
# The same model's batch-1 call split by stage from a profiler trace (MI300X, the same fork at
# 39a5930): ViT 4.1 ms, prefill 10.7, the 10 denoising steps 11.2, other 1.1; total 27.1.
PI0_DENOISE_SHARE = 11.2 / 27.1
PI0_DENOISE_STEPS = 10
# π0 (3.3B) training, 8 H200s under DDP (SDPA attention), sequence 512: samples/s of all 8
# against the batch per GPU. The same fork, BENCHMARK_H200.md at 02f0e52.
PI0_H200_TRAIN_SAMPLES_PER_S = {4: 218.0, 8: 279.0, 16: 320.0}
PI0_H200_GPUS = 8
# π0 on an RTX 4090 (Triton kernels, CUDA graphs), 10 flow steps, chunk 50, a 20-token prompt:
# 23.6, 32.9, 39.2 ms for 1, 2, 3 views (Ma et al. 2025, arXiv 2510.26742; github.com/Dexmal/realtime-vla).
PI0_4090_MS_3_VIEWS = 39.2
# OpenVLA (7B) "runs at approximately 6Hz on one NVIDIA RTX 4090 GPU" in BF16, without
# compilation or speculative decoding (Kim et al. 2024, arXiv 2406.09246, section 4.5).
OPENVLA_4090_HZ = 6.0


@dataclass(frozen=True)
class DeviceProfile:
    """One model on one device: what its calls cost (see the module docstring)."""

    name: str
    total_sms: int
    sm_granularity: int
    act_fixed_s: float
    act_per_row_s: float
    train_fixed_s: float
    train_per_sample_s: float
    denoise_steps: int = 0  # the steps the act figures were measured with (0: not a flow model)
    denoise_share: float = 0.0  # their share of a call
    sources: str = ""

    def act_s(self, rows: int, share: float = 1.0, steps: int | None = None) -> float:
        """Device seconds of a policy call of ``rows`` rows on ``share`` of the SMs (``steps``
        denoising steps, default the measured ones)."""
        scale = 1.0
        if steps is not None and self.denoise_steps:
            scale = 1.0 - self.denoise_share + self.denoise_share * steps / self.denoise_steps
        return scale * (self.act_fixed_s + self.act_per_row_s * rows / share)

    def value_s(self, rows: int, share: float = 1.0) -> float:
        """A value forward: the call without its denoising steps (the critic reads the prefix)."""
        return self.act_s(rows, share, steps=0)

    def train_s(self, samples: int, share: float = 1.0) -> float:
        """Device seconds of one training step (forward, backward, optimiser) on ``samples``."""
        return self.train_fixed_s + self.train_per_sample_s * samples / share


def _pi0_profiles() -> dict[str, DeviceProfile]:
    act_fixed, act_per_row = fit_line({b: ms / 1e3 for b, ms in PI0_H200_MS.items()})
    # one GPU's step time against its batch: b samples at (samples/s of 8 GPUs) / 8
    train_fixed, train_per_sample = fit_line({b: b / (sps / PI0_H200_GPUS)
                                              for b, sps in PI0_H200_TRAIN_SAMPLES_PER_S.items()})
    h200 = DeviceProfile("pi0-h200", total_sms=132, sm_granularity=8, act_fixed_s=act_fixed,
                         act_per_row_s=act_per_row, train_fixed_s=train_fixed, train_per_sample_s=train_per_sample,
                         denoise_steps=PI0_DENOISE_STEPS, denoise_share=PI0_DENOISE_SHARE,
                         sources="openpi-1 eb1e501 (batch curve), 39a5930 (stage split), 02f0e52 (DDP training)")
    # the RTX 4090 (128 SMs, compute capability 8.9: green contexts in 4s): its published batch-1
    # call, with the H200 curve's shape (no batch curve of a 4090 is published) and training
    # scaled by the same ratio
    scale = PI0_4090_MS_3_VIEWS / 1e3 / h200.act_s(1)
    rtx = replace(h200, name="pi0-4090", total_sms=128, sm_granularity=4, act_fixed_s=act_fixed * scale,
                  act_per_row_s=act_per_row * scale, train_fixed_s=train_fixed * scale,
                  train_per_sample_s=train_per_sample * scale,
                  sources="Dexmal realtime-vla (batch 1, 3 views), the pi0-h200 curve's shape")
    # OpenVLA: 6 Hz at batch 1 on a 4090, autoregressive (no denoising steps); the π0 curve's
    # shape for its batches, training scaled by the call's ratio to π0's on the same card
    openvla_scale = (1.0 / OPENVLA_4090_HZ) / rtx.act_s(1)
    openvla = replace(rtx, name="openvla-4090", act_fixed_s=rtx.act_fixed_s * openvla_scale,
                      act_per_row_s=rtx.act_per_row_s * openvla_scale, train_fixed_s=rtx.train_fixed_s * openvla_scale,
                      train_per_sample_s=rtx.train_per_sample_s * openvla_scale, denoise_steps=0, denoise_share=0.0,
                      sources="OpenVLA paper section 4.5 (6 Hz on a 4090), the pi0-h200 curve's shape")
    return {p.name: p for p in (h200, rtx, openvla)}


PROFILES: dict[str, DeviceProfile] = _pi0_profiles()


# ---------------------------------------------------------------- the device


@dataclass
class CallRecord:
    """One call the device ran: its side, when it was submitted, started and ended (clock seconds)."""

    side: str
    submitted: float
    start: float
    end: float
    modelled_s: float  # the model's duration (end - start)
    returned: float | None = None  # when the calling thread got its result (EmulatedPolicy sets it)
    sm_s: float = 0.0  # its part that scales with the SMs, on all of them (what it holds them for)
    work_s: float = field(init=False)  # its time on its SMs alone, before priority streams stretch it

    def __post_init__(self) -> None:
        self.work_s = self.modelled_s


class EmulatedDevice:
    """One emulated GPU running ``profile``, its sides sharing it as ``mode`` says
    (:class:`~ebrl.config.StreamMode`, as :class:`~ebrl.runtime.resources.gpu.GpuStreams` does on a GPU):

    - ``"priority-streams"`` (the default): each side has its own queue on every SM, and
      generation's kernels go first. A generation call runs as if alone; a training call runs
      at the pace of the SMs generation leaves it: generation's scaled part holds the SMs, its
      fixed (latency-bound) part does not. Work-conserving: a side alone has every SM.
    - ``"green-contexts"``: each side its own queue on its share of the SMs (:meth:`set_split`),
      the two at once.
    - ``"one-stream"``: one queue, all SMs, calls in submission order.

    ``clock``: seconds (``time.perf_counter``); waits call its ``sleep(s)`` where it has one
    (``time.sleep`` otherwise), so a clock that moves only when slept on makes it deterministic.
    Shared by the generator's and the learner's copy of a policy: copying returns the same device."""

    def __init__(self, profile: DeviceProfile | str, mode: StreamMode | str = StreamMode.PRIORITY_STREAMS,
                 clock: Callable[[], float] | None = None, gen_sms: int | None = None, keep_calls: int = 100_000):
        self.profile = PROFILES[profile] if isinstance(profile, str) else profile
        self.clock = clock or time.perf_counter
        self._sleep = getattr(clock, "sleep", time.sleep)
        self._lock = threading.Lock()
        self._free_at = {side: 0.0 for side in SIDES}  # when each queue's last call ends
        self.busy_s = {side: 0.0 for side in SIDES}  # modelled device seconds of each side's work, summed
        # each side's calls as they would run on the whole device: (fixed, per-SM-share) seconds
        self.work_s = {side: [0.0, 0.0] for side in SIDES}
        self.calls: list[CallRecord] = []  # the latest keep_calls calls
        self._stretchable: list[CallRecord] = []  # priority streams: training calls a generation call may still slow
        self.overruns = 0  # calls whose small model's CPU work took longer than the device's time
        self._keep = keep_calls
        self.mode, self.split = StreamMode.PRIORITY_STREAMS, None
        self.set_mode(mode, gen_sms)

    def set_mode(self, mode: StreamMode | str, gen_sms: int | None = None) -> None:
        """Share the device as ``mode`` says from now on (``gen_sms``: a split's start, default
        :func:`~ebrl.runtime.resources.gpu.start_split`)."""
        try:
            mode = StreamMode(mode)
        except ValueError:
            mode = None
        if mode not in MODES:
            raise ValueError(f"emulated device mode must be one of {[str(m) for m in MODES]}, got {mode!r}")
        p = self.profile
        with self._lock:
            self.mode = mode
            self.split = None if mode is not StreamMode.GREEN_CONTEXTS else (
                start_split(p.total_sms, p.sm_granularity) if gen_sms is None
                else clamp_split(p.total_sms, gen_sms, p.sm_granularity))

    def __deepcopy__(self, memo: dict) -> EmulatedDevice:
        return self  # one device, whichever copy of the policy calls it

    def share(self, side: str) -> float:
        """The fraction of the SMs ``side``'s calls run on now."""
        if self.split is None:
            return 1.0
        sms = self.split.generation if side == "generation" else self.split.training
        return sms / self.profile.total_sms

    def set_split(self, gen_sms: int) -> SmSplit:
        """Generation gets ``gen_sms`` SMs (rounded as green contexts are), training the rest;
        calls already queued keep the share they were given."""
        if self.mode is not StreamMode.GREEN_CONTEXTS:
            raise ValueError(f"a {self.mode} device has no SM split")
        with self._lock:
            self.split = clamp_split(self.profile.total_sms, gen_sms, self.profile.sm_granularity, reason="resplit")
        return self.split

    def submit(self, side: str, seconds: float | Callable[[float], float], at: float | None = None) -> CallRecord:
        """Queue a call of ``side`` submitted at ``at`` (default now) that takes ``seconds`` of
        device time (or ``seconds(share)``); returns its record (``.end``: when it ends; with
        priority streams a training call's end moves later while generation calls arrive)."""
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, got {side!r}")
        with self._lock:
            now = self.clock() if at is None else at
            modelled = seconds(self.share(side)) if callable(seconds) else float(seconds)
            # a cost is fixed + scaled / share: two points give both parts (a number is all fixed)
            scaled = seconds(0.5) - seconds(1.0) if callable(seconds) else 0.0
            work = self.work_s[side]
            work[0] += (seconds(1.0) if callable(seconds) else modelled) - scaled
            work[1] += scaled
            queue = SIDES[0] if self.mode is StreamMode.ONE_STREAM else side  # one stream: one queue for both
            start = max(now, self._free_at[queue])
            record = CallRecord(side, now, start, start + modelled, modelled, sm_s=scaled)
            self.busy_s[side] += modelled
            self.calls.append(record)
            if len(self.calls) > self._keep:
                del self.calls[: len(self.calls) - self._keep]
            if self.mode is StreamMode.PRIORITY_STREAMS:
                self._stretch(now, record if side == "training" else None)
            self._free_at[queue] = record.end
        return record

    def _stretch(self, now: float, new_training: CallRecord | None) -> None:
        """Priority streams: the ends of the training calls not yet done, each at the pace of the
        SMs generation's calls leave it (a training call makes progress ``1 - d`` where
        generation's calls hold a share ``d = sm_s / duration`` of the SMs); calls in order."""
        pending = [c for c in self._stretchable if c.end > now] + ([new_training] if new_training else [])
        self._stretchable = pending
        if not pending:
            return
        gen = []
        for c in reversed(self.calls):  # generation's calls end in the order they were submitted
            if c.side == "generation":
                if c.end <= pending[0].start:
                    break
                if c.sm_s > 0:
                    gen.append(c)
        free = pending[0].start
        for call in pending:
            call.start = start = max(call.submitted, free)
            end = start + call.work_s
            for _ in range(1000):  # a fixed point: the later the end, the more generation overlaps it
                held = sum(g.sm_s / g.modelled_s * max(0.0, min(g.end, end) - max(g.start, start)) for g in gen)
                new_end = start + call.work_s + held
                if new_end - end < 1e-12:
                    break
                end = new_end
            call.end = free = end
            call.modelled_s = end - start
        self._free_at["training"] = free

    def wait(self, call: CallRecord) -> None:
        """Block the calling thread until ``call`` ends (a host thread waiting on the device);
        a call that generation's later calls stretched is waited for again."""
        while True:
            with self._lock:
                left = call.end - self.clock()
            if left <= 0:
                return
            self._sleep(left)

    def _records(self) -> list[CallRecord]:
        """A copy of the call records: read outside the lock, which the calls' submits take."""
        with self._lock:
            return list(self.calls)

    def busy_between(self, t0: float, t1: float) -> float:
        """Seconds in ``[t0, t1]`` during which any call ran (what NVML's utilisation counts)."""
        spans = sorted((max(c.start, t0), min(c.end, t1)) for c in self._records() if c.end > t0 and c.start < t1)
        busy, reach = 0.0, t0
        for s, e in spans:
            if e > reach:
                busy += e - max(s, reach)
                reach = e
        return busy

    def held_errors(self) -> list[float]:
        """Per returned call: how far the time its caller was held past the call's start
        (``returned - start``) is from the model's duration, relative to it (sleep overshoot, or
        the small model's CPU work running past the device's time)."""
        return [abs((c.returned - c.start) - c.modelled_s) / c.modelled_s
                for c in self._records() if c.returned is not None and c.modelled_s > 0]

    def split_ceiling(self) -> float:
        """The most an SM split could gain over one stream on the calls made so far: their time
        one after another on the whole device over the least time any split (in granules) takes
        for them with both sides' queues never empty. A bound, not a prediction: it ignores
        that a side waits for the other's results."""
        p = self.profile
        (gen_fixed, gen_scaled), (train_fixed, train_scaled) = self.work_s["generation"], self.work_s["training"]
        one_stream = gen_fixed + gen_scaled + train_fixed + train_scaled
        splits = (clamp_split(p.total_sms, gen, p.sm_granularity) for gen in range(1, p.total_sms, p.sm_granularity))
        best = min(max(gen_fixed + gen_scaled * p.total_sms / s.generation,
                       train_fixed + train_scaled * p.total_sms / s.training) for s in splits)
        return one_stream / best if best > 0 else 1.0

    # the device as the runtime sees it (ebrl.runtime.platform.Device): training stays in this
    # process, beside generation on the same device
    in_process_only = True

    @property
    def name(self) -> str:
        return f"the emulated device {self.profile.name}"

    def streams(self, mode: StreamMode) -> EmulatedStreams:
        return EmulatedStreams.of(self, mode)

    def nvml(self) -> _Nvml:
        """An object with the ``pynvml`` functions :class:`~ebrl.telemetry.system.SystemSampler`
        calls, reporting this device (utilisation since the facade's previous query)."""
        return _Nvml(self)

    def describe(self) -> dict[str, Any]:
        split = self.split
        return {"profile": self.profile.name, "mode": str(self.mode), "total_sms": self.profile.total_sms,
                "gen_sms": split and split.generation, "train_sms": split and split.training,
                "busy_s": {k: round(v, 3) for k, v in self.busy_s.items()}}


class _Nvml:
    """The ``pynvml`` calls the system sampler makes, answered by an emulated device."""

    NVMLError = RuntimeError

    def __init__(self, device: EmulatedDevice):
        self.device = device
        self._last = device.clock()

    def nvmlInit(self) -> None:
        self._last = self.device.clock()

    def nvmlShutdown(self) -> None:  # nothing was opened
        return None

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> EmulatedDevice:
        return self.device

    def nvmlDeviceGetUtilizationRates(self, handle: EmulatedDevice) -> SimpleNamespace:
        now = handle.clock()
        window, self._last = now - self._last, now
        busy = handle.busy_between(now - window, now) if window > 0 else 0.0
        return SimpleNamespace(gpu=round(100.0 * busy / window, 1) if window > 0 else 0.0, memory=0.0)

    def nvmlDeviceGetMemoryInfo(self, handle: EmulatedDevice) -> SimpleNamespace:
        return SimpleNamespace(used=0, total=0, free=0)  # memory is not modelled


# ---------------------------------------------------------------- what the runtime sees


@dataclass
class EmulatedStreams(GpuStreams):
    """:class:`~ebrl.runtime.resources.gpu.GpuStreams` for an emulated device, in the mode the
    run asks for (``resources.gpu_streams``; ``cpu``, no streams, is one stream on a device). In
    ``green-contexts`` the controller's SM-quota rule resplits it. No CUDA stream exists:
    entering a side does nothing, and weights need no event (the small model's copies are made
    on the CPU)."""

    emulator: EmulatedDevice | None = field(default=None, repr=False)

    @classmethod
    def of(cls, device: EmulatedDevice, mode: StreamMode | str | None = None) -> EmulatedStreams:
        """Streams on ``device``, which is set to ``mode`` (default: as it is)."""
        if mode is not None:
            mode = StreamMode(mode)
            device.set_mode(StreamMode.ONE_STREAM if mode is StreamMode.CPU else mode)
        p = device.profile
        return cls(device.mode, total_sms=p.total_sms, split=device.split, granularity=p.sm_granularity,
                   fallback_reason=f"emulated device {p.name}", emulator=device)

    def resplit(self, gen_sms: int) -> bool:
        if self.mode is not StreamMode.GREEN_CONTEXTS:
            return False
        old = self.split
        self.split = self.emulator.set_split(gen_sms)
        return old is None or self.split.generation != old.generation

    def describe(self) -> dict:
        return {**super().describe(), "emulated": self.emulator.describe()}


class EmulatedPolicy(nn.Module):
    """``policy`` (a small model on the CPU: the numbers) whose calls take ``device`` time (the
    clock): ``act`` on the generation side, ``evaluate`` (one training step's minibatch, or a
    forward without gradients) and ``value`` on the training side. Every other attribute is the wrapped policy's.

    A call returns when both are done: the small model's CPU work and the device's modelled
    time from the call's start. The device counts in ``overruns`` the calls whose CPU work took
    longer than it would have (the emulation is then slower than the device it models)."""

    def __init__(self, policy: nn.Module, device: EmulatedDevice):
        super().__init__()
        self.policy = policy
        self.emulator = device
        self.runtime_device = device  # the device run() shares between generation and training
        self._steps = getattr(policy, "denoise_steps", None)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # parameters, buffers, submodules
        except AttributeError:
            return getattr(super().__getattr__("policy"), name)

    def _on_device(self, side: str, seconds: Callable[[float], float], fn: Callable[[], Any]) -> Any:
        device = self.emulator
        call = device.submit(side, seconds)
        out = fn()
        if device.clock() > call.end:
            device.overruns += 1
        device.wait(call)
        call.returned = device.clock()
        return out

    def act(self, obs: Any):
        rows = batch_size(obs)
        return self._on_device("generation", lambda share: self.emulator.profile.act_s(rows, share, self._steps),
                               lambda: self.policy.act(obs))

    def evaluate(self, obs: Any, actions: torch.Tensor):
        """A training step's minibatch (with gradients); without them a forward (a proximal
        policy's log-probs), which costs what a policy call of those rows costs."""
        rows, profile = int(actions.shape[0]), self.emulator.profile
        cost = ((lambda share: profile.train_s(rows, share)) if torch.is_grad_enabled()
                else (lambda share: profile.act_s(rows, share, self._steps)))
        return self._on_device("training", cost, lambda: self.policy.evaluate(obs, actions))

    def value(self, obs: Any) -> torch.Tensor:
        rows = batch_size(obs)
        return self._on_device("training", lambda share: self.emulator.profile.value_s(rows, share),
                               lambda: self.policy.value(obs))


def emulator_of(policy: Any) -> EmulatedDevice | None:
    """The emulated device a policy runs on, or None for a real one."""
    return getattr(policy, "emulator", None) if isinstance(policy, EmulatedPolicy) else None


def emulated(policy: nn.Module, profile: DeviceProfile | str = "pi0-h200") -> EmulatedPolicy:
    """``policy`` on a new emulated device running ``profile`` (``"pi0-h200"``, ``"pi0-4090"``,
    ``"openvla-4090"`` or a :class:`DeviceProfile`). A run shares the device between its sides
    as ``resources.gpu_streams`` says, as it would a GPU.

        >>> import gymnasium as gym
        >>> from ebrl.policies import MLPPolicy
        >>> small = MLPPolicy.from_spaces(gym.spaces.Box(-1, 1, (3,)), gym.spaces.Box(-1, 1, (2,)), hidden=(8,))
        >>> policy = emulated(small, "pi0-h200")
        >>> policy.emulator.describe()["profile"], emulator_of(policy) is policy.emulator
        ('pi0-h200', True)
    """
    if isinstance(profile, str) and profile not in PROFILES:
        raise ValueError(f"no emulated device profile {profile!r}: one of {sorted(PROFILES)}")
    return EmulatedPolicy(policy, EmulatedDevice(profile))


__all__ = ["PROFILES", "DeviceProfile", "EmulatedDevice", "EmulatedPolicy", "EmulatedStreams",
           "emulated", "emulator_of", "fit_line"]
