"""CPU and GPU utilisation, sampled once per update: cheap, non-blocking, never raising.

:class:`SystemSampler` reports, between one :meth:`~SystemSampler.sample` and the next:

- ``cpu_core_<i>_util``: busy percent of each logical core (from ``psutil.cpu_times(percpu=True)``
  deltas kept by the sampler, so two samplers, e.g. the metrics' and the live profiler's, do not
  disturb each other as ``psutil.cpu_percent``'s module-wide state would);
- ``cpu_util_mean``: their mean;
- ``proc_cpu_util``: CPU percent of this process and its children (sim workers, the learner
  process), summed like ``top`` does, so 250 means two and a half cores;
- ``gpu<i>_sm_util`` and ``gpu<i>_mem_used_mib`` per GPU, where ``pynvml`` (nvidia-ml-py)
  can initialise and finds one. Without a driver or GPU ``nvmlInit`` raises ``NVMLError``:
  then there are simply no GPU keys.

Every call is a few reads of ``/proc`` (and NVML queries): no sleep, no thread.

    >>> from ebrl.telemetry.system import SystemSampler
    >>> sampler = SystemSampler()
    >>> sample = sampler.sample()
    >>> {"cpu_util_mean", "proc_cpu_util", "cpu_core_0_util"} <= set(sample)
    True
    >>> sampler.close()
"""

from __future__ import annotations

import importlib
import time
from typing import Any

import psutil


class SystemSampler:
    """Per-core and process-tree CPU utilisation, and per-GPU SM utilisation and memory.

    ``nvml`` is the ``pynvml`` module (tests pass a fake); ``None`` imports the real one,
    ``False`` skips GPUs. The list of child processes is refreshed at most every
    ``children_every_s``: finding them scans all of ``/proc`` (milliseconds), and the tree
    (sim workers, the learner process) rarely changes during a run.
    """

    def __init__(self, nvml: Any = None, children_every_s: float = 10.0):
        self._proc = psutil.Process()
        self._children: dict[int, psutil.Process] = {}  # pid -> Process: cpu_percent compares with its last call
        self._children_every_s = children_every_s
        self._children_at = -float("inf")
        self._nvml, self._gpus = None, []
        if nvml is not False:
            self._init_gpus(nvml)
        self.sample()  # primes the counters: each sample covers the time since the previous one

    def _init_gpus(self, nvml: Any) -> None:
        try:
            nvml = nvml or importlib.import_module("pynvml")
            nvml.nvmlInit()
        except Exception:  # no package, no driver, no GPU (NVMLError): CPU-only host
            return
        try:
            self._gpus = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
            self._nvml = nvml
        except Exception:
            self._gpus = []
            _shutdown(nvml)

    def sample(self) -> dict[str, float]:
        """Utilisation since the previous call, as ``{key: percent or MiB}``."""
        out: dict[str, float] = {}
        cores = self._cores()
        for i, util in enumerate(cores):
            out[f"cpu_core_{i}_util"] = float(util)
        out["cpu_util_mean"] = float(sum(cores) / len(cores)) if cores else 0.0
        out["proc_cpu_util"] = self._tree_cpu()
        if self._nvml is not None:
            out.update(self._gpu_sample())
        return out

    def _cores(self) -> list[float]:
        times = psutil.cpu_times(percpu=True)
        last, self._last_cores = getattr(self, "_last_cores", None), times
        if last is None or len(last) != len(times):
            return [0.0] * len(times)
        out = []
        for a, b in zip(last, times):
            total = sum(b) - sum(a)
            idle = (b.idle + getattr(b, "iowait", 0.0)) - (a.idle + getattr(a, "iowait", 0.0))
            out.append(100.0 * max(0.0, 1.0 - idle / total) if total > 0 else 0.0)
        return out

    def _tree_cpu(self) -> float:
        now = time.monotonic()
        if now - self._children_at >= self._children_every_s:
            self._children_at = now
            try:
                kids = self._proc.children(recursive=True)
            except psutil.Error:
                kids = []
            # keep the cached objects: a fresh Process's first cpu_percent() is 0.0 (nothing to compare with)
            self._children = {k.pid: self._children.get(k.pid, k) for k in kids}
        total = _cpu(self._proc)
        for pid, proc in list(self._children.items()):
            try:
                total += proc.cpu_percent(interval=None)
            except psutil.Error:  # it ended
                del self._children[pid]
        return float(total)

    def _gpu_sample(self) -> dict[str, float]:
        nvml, out = self._nvml, {}
        for i, handle in enumerate(self._gpus):
            try:
                sm = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
                mem = nvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20
            except Exception:  # not supported (MIG), or the GPU fell off the bus: leave this one out
                continue
            out[f"gpu{i}_sm_util"], out[f"gpu{i}_mem_used_mib"] = sm, mem
        return out

    def close(self) -> None:
        if self._nvml is not None:
            _shutdown(self._nvml)
            self._nvml, self._gpus = None, []


def _cpu(proc: psutil.Process) -> float:
    try:
        return float(proc.cpu_percent(interval=None))
    except psutil.Error:  # ended between listing and reading
        return 0.0


def _shutdown(nvml: Any) -> None:
    try:
        nvml.nvmlShutdown()
    except Exception:
        pass
