"""Live metrics: history.jsonl and TensorBoard scalars per update, result.json, system telemetry,
`ebrl plot` on a run that is still going, and no writer thread outliving run()."""

import asyncio
import json
import math
import sys
import threading
import types

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import ebrl
from ebrl.algos import PPO
from ebrl.cli import main
from ebrl.policies import MLPPolicy
from ebrl.telemetry.metrics import MetricsLog, read_history
from ebrl.telemetry.plots import load_rows
from ebrl.telemetry.system import SystemSampler
from ebrl.testing import MockEnv, run_virtual

# tags every update writes, whatever the env and the host
RUNTIME_TAGS = ["charts/mean_return", "charts/episodes", "perf/env_steps_per_s", "perf/env_steps_per_s_overall",
                "perf/update_s", "perf/gen_batch_mean", "perf/publish_bytes", "perf/publish_s", "lag/mean", "lag/max", "counters/trained",
                "counters/dropped", "losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/approx_kl"]


def trainer(log_dir=None, total=640, learner="thread", algo=None, **cfg):
    config = ebrl.RunConfig(num_envs=4, segment_len=16, total_env_steps=total, learner=learner,
                            log_dir=None if log_dir is None else str(log_dir), **cfg)
    return ebrl.Trainer(lambda i: MockEnv(dim=3, episode_len=8), MLPPolicy(3, 3, seed=0),
                        algo or PPO(minibatch_size=32), config)


def scalars(log_dir) -> dict[str, list]:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    return {tag: acc.Scalars(tag) for tag in acc.Tags()["scalars"]}


def same_rows(a, b) -> bool:
    """history.jsonl is strict JSON: a NaN in memory (no episode finished yet) is null on disk."""
    def strict(rows):
        return [{k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in r.items()} for r in rows]
    return json.dumps(strict(a), allow_nan=False) == json.dumps(strict(b), allow_nan=False)


class FakeNVMLError(Exception):
    pass


def fake_pynvml(gpus=2, init_error=False):
    """A stand-in for nvidia-ml-py's ``pynvml``: ``gpus`` GPUs at 40 + i percent SM, (i + 1) GiB used."""
    nvml = types.ModuleType("pynvml")
    nvml.NVMLError = FakeNVMLError
    nvml.calls = []

    def init():
        nvml.calls.append("init")
        if init_error:
            raise FakeNVMLError("NVML Shared Library Not Found")

    nvml.nvmlInit = init
    nvml.nvmlShutdown = lambda: nvml.calls.append("shutdown")
    nvml.nvmlDeviceGetCount = lambda: gpus
    nvml.nvmlDeviceGetHandleByIndex = lambda i: ("gpu", i)
    nvml.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=40 + h[1], memory=7)
    nvml.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=(h[1] + 1) * 2**30, total=80 * 2**30)
    return nvml


def test_history_and_tensorboard_have_one_point_per_update_with_gpu_telemetry(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpus=2))
    res = ebrl.run_sync(trainer(tmp_path))
    assert res.updates >= 5
    rows = read_history(tmp_path / "history.jsonl")
    assert len(rows) == res.updates and same_rows(rows, res.history)
    assert [r["update"] for r in rows] == list(range(1, res.updates + 1))
    assert rows[-1]["trained"] == res.trained and rows[-1]["env_steps"] == res.env_steps
    assert all(r["lag_max"] <= 1 and 0 <= r["lag_mean"] <= r["lag_max"] for r in rows)
    assert (rows[0]["gpu0_sm_util"], rows[0]["gpu1_sm_util"], rows[0]["gpu1_mem_used_mib"]) == (40.0, 41.0, 2048.0)
    assert "cpu_core_0_util" in rows[0] and "proc_cpu_util" in rows[0]

    tb = scalars(tmp_path)
    system = ["system/cpu_core_0_util", "system/cpu_util_mean", "system/proc_cpu_util",
              "system/gpu0_sm_util", "system/gpu0_mem_used_mib", "system/gpu1_sm_util"]
    for tag in RUNTIME_TAGS + system:
        assert len(tb.get(tag, [])) == res.updates, tag
    assert "charts/success_rate" not in tb  # MockEnv reports no success
    assert [e.step for e in tb["counters/trained"]] == [r["env_steps"] for r in rows]  # x axis: env steps
    assert [e.value for e in tb["lag/max"]] == [r["lag_max"] for r in rows]
    assert [e.value for e in tb["system/gpu0_sm_util"]] == [40.0] * res.updates
    assert same_rows(json.loads((tmp_path / "result.json").read_text())["history"], res.history)


def test_virtual_time_writes_the_same_files_and_stays_deterministic(tmp_path):
    a = run_virtual(trainer(tmp_path / "a"))
    b = run_virtual(trainer(tmp_path / "b"))
    assert same_rows(a.history, b.history)  # no wall-clock or system keys under virtual time
    rows = read_history(tmp_path / "a" / "history.jsonl")
    assert len(rows) == a.updates and same_rows(rows, a.history)
    assert not any(k.startswith(("cpu_", "gpu", "proc_")) for k in rows[0])
    tb = scalars(tmp_path / "a")
    assert all(len(tb[tag]) == a.updates for tag in RUNTIME_TAGS)
    result = json.loads((tmp_path / "a" / "result.json").read_text())
    assert result["updates"] == a.updates and result["env_steps"] == a.env_steps


def test_no_log_dir_writes_nothing_and_creates_no_summary_writer(tmp_path, monkeypatch):
    import torch.utils.tensorboard

    def no_writer(*args, **kwargs):
        raise AssertionError("SummaryWriter created without a log_dir")

    monkeypatch.setattr(torch.utils.tensorboard, "SummaryWriter", no_writer)
    monkeypatch.chdir(tmp_path)
    res = ebrl.run_sync(trainer(None))
    assert res.updates >= 5 and len(res.history) == res.updates  # rows still kept in memory
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("learner", ["thread", "process"])
def test_no_thread_outlives_run(tmp_path, learner):
    before = set(threading.enumerate())
    res = ebrl.run_sync(trainer(tmp_path, learner=learner))
    assert res.learner_mode == learner and res.updates >= 5
    assert set(threading.enumerate()) <= before  # the TensorBoard writer's thread was joined
    assert len(scalars(tmp_path)["lag/mean"]) == res.updates  # and flushed everything first


class FailingPPO(PPO):
    """Raises in its third update."""

    def update(self, policy, batch):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 3:
            raise RuntimeError("boom in update 3")
        return super().update(policy, batch)


def test_an_error_in_the_run_still_flushes_and_closes_the_writer(tmp_path):
    before = set(threading.enumerate())
    with pytest.raises(RuntimeError, match="boom in update 3"):
        ebrl.run_sync(trainer(tmp_path, total=10_000, algo=FailingPPO(minibatch_size=32)))
    assert set(threading.enumerate()) <= before
    assert len(read_history(tmp_path / "history.jsonl")) == 2  # the updates before the error, each on disk
    assert len(scalars(tmp_path)["losses/policy_loss"]) == 2
    assert not (tmp_path / "result.json").exists()  # no result: the run did not finish


def test_cancelling_run_closes_the_writer(tmp_path):
    history = tmp_path / "history.jsonl"

    async def main_():
        task = asyncio.create_task(ebrl.run(trainer(tmp_path, total=10_000_000)))
        while not (history.exists() and history.read_text().count("\n") >= 2):  # written while it runs
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    before = set(threading.enumerate())
    asyncio.run(main_())
    assert set(threading.enumerate()) <= before
    rows = read_history(history)
    assert len(rows) >= 2 and len(scalars(tmp_path)["lag/mean"]) == len(rows)


def test_cli_puts_every_file_in_run_log_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a default runs/ directory would appear here
    out = tmp_path / "out"
    code = main(["train", "--quiet", "--set", "env=mock/4", "--set", "run.total_env_steps=1000",
                 "--set", "run.num_envs=4", "--set", "run.segment_len=16", "--set", f"run.log_dir={out}"])
    assert code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    names = sorted(p.name for p in out.iterdir())
    assert {"events.jsonl", "spec.json", "result.json", "history.jsonl", "checkpoint.pt"} <= set(names)
    assert any(n.startswith("events.out.tfevents.") for n in names)
    result = json.loads((out / "result.json").read_text())
    assert json.loads((out / "spec.json").read_text())["run"]["log_dir"] == str(out)
    rows = read_history(out / "history.jsonl")
    assert len(rows) == result["updates"] > 0 and same_rows(rows, result["history"])
    tb = scalars(out)
    for tag in ["charts/mean_return", "losses/policy_loss", "perf/env_steps_per_s", "lag/mean", "lag/max"]:
        assert len(tb[tag]) == result["updates"], tag


def test_plot_a_live_run_ignores_a_partial_last_line(tmp_path, capsys):
    res = run_virtual(trainer(tmp_path))
    history = tmp_path / "history.jsonl"
    (tmp_path / "result.json").unlink()  # as if the run were still going
    with history.open("a") as f:
        f.write('{"update": 999, "env_steps": 99')  # the row being written
    rows, _ = load_rows(history)
    assert len(rows) == res.updates and same_rows(rows, res.history)
    assert main(["plot", str(tmp_path)]) == 0  # a run directory: its history.jsonl
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plot", str(history), "--out", str(tmp_path / "h.png")]) == 0
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    history.write_text("")  # no update yet
    assert main(["plot", str(history)]) == 2
    assert "no finished episodes" in capsys.readouterr().err


def test_a_corrupt_complete_line_is_an_error_naming_it(tmp_path):
    path = tmp_path / "history.jsonl"
    path.write_text('{"update": 1}\nnot json\n{"update": 3}\n')
    with pytest.raises(ValueError, match="history.jsonl:2"):
        read_history(path)


def test_system_sampler_reads_gpus_through_pynvml(monkeypatch):
    nvml = fake_pynvml(gpus=2)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    sampler = SystemSampler()
    sample = sampler.sample()
    assert {k: v for k, v in sample.items() if k.startswith("gpu")} == {
        "gpu0_sm_util": 40.0, "gpu0_mem_used_mib": 1024.0, "gpu1_sm_util": 41.0, "gpu1_mem_used_mib": 2048.0}
    sampler.close()
    assert nvml.calls == ["init", "shutdown"]


def test_system_sampler_without_a_gpu_has_cpu_keys_only(monkeypatch):
    import psutil

    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_error=True))  # what a CPU host's driver says
    sample = SystemSampler().sample()
    cores = psutil.cpu_count()
    assert [f"cpu_core_{i}_util" for i in range(cores)] == [k for k in sample if k.startswith("cpu_core_")]
    assert not any(k.startswith("gpu") for k in sample)
    assert all(0.0 <= sample[f"cpu_core_{i}_util"] <= 100.0 for i in range(cores))


def test_system_sampler_with_the_real_pynvml():
    import pynvml

    try:
        pynvml.nvmlInit()
        gpus = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:  # no driver or no GPU: the normal case on a CPU host
        gpus = 0
    sampler = SystemSampler()  # must not raise either way
    sample = sampler.sample()
    sampler.close()
    assert sum(k.endswith("_sm_util") for k in sample) == gpus
    assert sample["proc_cpu_util"] >= 0.0


def test_metrics_log_without_a_dir_is_memory_only():
    log = MetricsLog(None)
    log.open()
    log.record({"update": 1, "env_steps": 8, "policy_loss": 0.5})
    log.close()
    assert log.rows == [{"update": 1, "env_steps": 8, "policy_loss": 0.5}]


def test_each_row_is_on_disk_as_soon_as_it_is_recorded(tmp_path):
    log = MetricsLog(tmp_path)
    log.open()
    for i in range(1, 4):
        log.record({"update": i, "env_steps": 8 * i, "policy_loss": 0.5})
        assert len(read_history(tmp_path / "history.jsonl")) == i  # flushed per row, not at close
    log.close()
    log.close()  # idempotent: run() may close after an error already closed it


def test_process_tree_cpu_counts_the_children():
    """A child computes a known amount of CPU time between two samples: the sample counts at least
    that CPU time over the samples' interval, whatever share of a core the machine gave the child."""
    import os
    import subprocess
    import time

    burn_s = 0.1
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "sys.stdin.readline()\n"
        f"end = time.process_time() + {burn_s}\n"
        "while time.process_time() < end:\n"
        "    pass\n"
        "print('done', flush=True)\n"
        "sys.stdin.readline()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        sampler = SystemSampler(nvml=False, children_every_s=3600.0)  # lists the child once, now
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "done\n"  # it has computed burn_s since the sampler's first look
        util = sampler.sample()["proc_cpu_util"]
        span = time.monotonic() - t0  # holds the samples' interval
        # /proc counts CPU time in clock ticks (user and system each truncated); percent rounded to 0.1
        tick = 1.0 / os.sysconf("SC_CLK_TCK")
        assert util >= 100.0 * (burn_s - 2 * tick) / span - 0.05, (util, span)
    finally:
        child.kill()
        child.wait()
    assert sampler.sample()["proc_cpu_util"] >= 0.0  # the ended child, still listed, is dropped, not an error
