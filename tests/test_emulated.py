"""The emulated accelerator: its model against the published figures, its queues, its
utilisation as NVML reports it, and a run whose policy generates and trains on it."""

import copy
from dataclasses import replace

import gymnasium as gym
import numpy as np
import pytest
import torch

import ebrl
from ebrl.algos import PPO
from ebrl.config import ConfigError
from ebrl.emulated import (PI0_H200_MS, PI0_H200_TRAIN_SAMPLES_PER_S, PROFILES, DeviceProfile, EmulatedDevice,
                           EmulatedStreams, emulated, emulator_of)
from ebrl.policies import MLPPolicy
from ebrl.runtime.resources.gpu import StreamMode
from ebrl.telemetry.system import SystemSampler
from ebrl.testing import Latency, MockEnv

# a device fast enough for a test run: 2 ms a call plus 0.1 ms a row, 3 ms a training step plus 0.05 ms a sample
FAST = DeviceProfile("test", total_sms=132, sm_granularity=8, act_fixed_s=2e-3, act_per_row_s=1e-4,
                     train_fixed_s=3e-3, train_per_sample_s=5e-5)


class FakeClock:
    """A device clock that moves only when slept on: ``clock()`` and ``sleep(s)``."""

    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += max(0.0, s)


def small_policy(seed=0):
    return MLPPolicy.from_spaces(gym.spaces.Box(-1, 1, (3,)), gym.spaces.Box(-1, 1, (3,)), hidden=(16,), seed=seed)


def test_the_pi0_profile_is_the_least_squares_line_through_the_published_figures():
    p = PROFILES["pi0-h200"]
    for rows, ms in PI0_H200_MS.items():  # the published curve is close to a line: within 3% everywhere
        assert p.act_s(rows) * 1e3 == pytest.approx(ms, rel=0.03)
    for b, sps in PI0_H200_TRAIN_SAMPLES_PER_S.items():  # one GPU's step of b samples at (8 GPUs' samples/s) / 8
        assert p.train_s(b) == pytest.approx(b / (sps / 8), rel=0.02)
    # the other cards' batch-1 calls are their published figures
    assert PROFILES["pi0-4090"].act_s(1) == pytest.approx(0.0392)
    assert 1.0 / PROFILES["openvla-4090"].act_s(1) == pytest.approx(6.0)
    # fewer denoising steps cost less: only their share of the call scales
    assert p.act_s(1, steps=0) == pytest.approx(p.act_s(1) * (1 - 11.2 / 27.1))


def test_one_stream_runs_the_sides_in_submission_order_and_a_split_or_priority_streams_at_once():
    for mode, gen_start in (("one-stream", 1.0), ("green-contexts", 0.5), ("priority-streams", 0.5)):
        device = EmulatedDevice(FAST, mode=mode, clock=FakeClock())
        train_end = device.submit("training", 1.0, at=0.0).end
        gen_end = device.submit("generation", 0.25, at=0.5).end
        assert train_end == 1.0
        assert gen_end == gen_start + 0.25  # one stream: after the training call; split: at once
        assert device.busy_s == {"generation": 0.25, "training": 1.0}


def test_priority_streams_run_generation_first_and_training_on_the_sms_it_leaves():
    mixed = DeviceProfile("mixed", total_sms=132, sm_granularity=8, act_fixed_s=0.1, act_per_row_s=0.05,
                          train_fixed_s=0.0, train_per_sample_s=0.25)
    clock = FakeClock()
    device = EmulatedDevice(mixed, clock=clock)
    assert device.mode == "priority-streams" and device.split is None  # the default, as a GPU run's
    train = device.submit("training", lambda s: mixed.train_s(4, s), at=0.0)
    assert train.end == 1.0  # alone: every SM
    gen = device.submit("generation", lambda s: mixed.act_s(4, s), at=0.5)
    assert (gen.start, gen.end) == (0.5, pytest.approx(0.8))  # at once, as if alone
    # generation held the SMs for its scaled part (0.2 s) and left them during its fixed part
    assert train.end == pytest.approx(1.2) and train.modelled_s == pytest.approx(1.2)
    device.wait(train)
    assert clock() == pytest.approx(1.2)  # the caller waits for the stretched end
    after = device.submit("generation", lambda s: mixed.act_s(4, s))
    assert train.end == pytest.approx(1.2) and after.start == pytest.approx(1.2)  # a call done is not stretched
    # the next training call queues behind the first and is stretched by the call still running
    nxt = device.submit("training", lambda s: mixed.train_s(2, s), at=1.2)
    assert nxt.start == pytest.approx(1.2) and nxt.end == pytest.approx(1.2 + 0.5 + 0.2)
    assert device.busy_s == {"generation": pytest.approx(0.6), "training": pytest.approx(1.5)}  # each side's own work
    only_fixed = EmulatedDevice(replace(mixed, act_per_row_s=0.0), clock=FakeClock())
    train = only_fixed.submit("training", lambda s: mixed.train_s(4, s), at=0.0)
    only_fixed.submit("generation", lambda s: only_fixed.profile.act_s(4, s), at=0.2)
    assert train.end == 1.0  # latency-bound calls hold no SMs: both run at full pace


def test_a_split_gives_each_side_its_share_and_the_fixed_part_no_faster():
    device = EmulatedDevice(FAST, mode="green-contexts", clock=FakeClock(), gen_sms=32)
    assert (device.split.generation, device.split.training) == (32, 96)
    share = device.share("generation")
    assert share == pytest.approx(32 / 132)
    end = device.submit("generation", lambda s: FAST.act_s(10, s), at=0.0).end
    assert end == pytest.approx(2e-3 + 10 * 1e-4 * 132 / 32)
    device.set_split(64)
    assert device.share("training") == pytest.approx(64 / 132)
    with pytest.raises(ValueError, match="one-stream"):
        EmulatedDevice(FAST, mode="one-stream").set_split(32)
    with pytest.raises(ValueError, match="mode must be one of"):
        EmulatedDevice(FAST, mode="split")


def test_the_split_ceiling_is_what_overlapping_the_fixed_parts_can_gain():
    only_fixed = DeviceProfile("fixed", total_sms=132, sm_granularity=8, act_fixed_s=1.0, act_per_row_s=0.0,
                               train_fixed_s=1.0, train_per_sample_s=0.0)
    device = EmulatedDevice(only_fixed, mode="one-stream", clock=FakeClock())
    device.submit("generation", lambda s: only_fixed.act_s(4, s))
    device.submit("training", lambda s: only_fixed.train_s(4, s))
    assert device.work_s == {"generation": [1.0, 0.0], "training": [1.0, 0.0]}
    assert device.split_ceiling() == pytest.approx(2.0)  # latency-bound calls: two at once
    only_scaled = DeviceProfile("scaled", total_sms=132, sm_granularity=8, act_fixed_s=0.0, act_per_row_s=0.25,
                                train_fixed_s=0.0, train_per_sample_s=0.75)
    # the shares it ran on do not matter
    device = EmulatedDevice(only_scaled, mode="green-contexts", clock=FakeClock())
    device.submit("generation", lambda s: only_scaled.act_s(4, s))
    device.submit("training", lambda s: only_scaled.train_s(4, s))
    assert device.work_s["generation"] == pytest.approx([0.0, 1.0]) and device.work_s["training"] == pytest.approx([0.0, 3.0])
    # calls that fill the device gain nothing from a split, and lose the 4 SMs no granule of 8 holds
    assert device.split_ceiling() == pytest.approx(128 / 132)


def test_nvml_reports_the_share_of_the_window_any_call_ran():
    clock = FakeClock()
    device = EmulatedDevice(FAST, mode="green-contexts", clock=clock)
    nvml = device.nvml()
    device.submit("training", 0.5, at=0.0)
    device.submit("generation", 0.25, at=0.25)  # overlaps the training call: busy is their union
    clock.sleep(1.0)
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetUtilizationRates(handle).gpu == pytest.approx(50.0)
    clock.sleep(1.0)
    assert nvml.nvmlDeviceGetUtilizationRates(handle).gpu == 0.0  # the next window: idle
    sampler = SystemSampler(nvml=device.nvml())
    assert {k for k in sampler.sample() if k.startswith("gpu")} == {"gpu0_sm_util", "gpu0_mem_used_mib"}
    sampler.close()


def test_the_policy_returns_the_small_models_numbers_after_the_modelled_time():
    clock = FakeClock()
    policy = emulated(small_policy(), FAST)
    policy.emulator.set_mode("one-stream")
    policy.emulator.clock, policy.emulator._sleep = clock, clock.sleep
    reference = small_policy()
    obs = np.zeros((4, 3), np.float32)
    out = policy.act(obs)
    assert clock() == pytest.approx(FAST.act_s(4))
    np.testing.assert_array_equal(out.actions, reference.act(obs).actions)
    with torch.no_grad():  # a forward on the training side costs a call of those rows
        policy.evaluate(torch.zeros(8, 3), torch.zeros(8, 3))
    assert clock() == pytest.approx(FAST.act_s(4) + FAST.act_s(8))
    policy.evaluate(torch.zeros(8, 3), torch.zeros(8, 3))  # with gradients: a training step
    assert policy.emulator.busy_s["training"] == pytest.approx(FAST.act_s(8) + FAST.train_s(8))
    # the acting copy shares the device; weights move between the copies under the same keys
    acting = copy.deepcopy(policy)
    assert acting.emulator is policy.emulator and emulator_of(acting) is policy.emulator
    acting.load_state_dict(policy.state_dict())
    assert policy.expected_spaces() == reference.expected_spaces()  # what it does not define is the small model's


def test_emulated_streams_set_the_devices_mode_and_resplit_green_contexts():
    streams = EmulatedStreams.of(EmulatedDevice(FAST, mode="one-stream"), "green-contexts")
    assert streams.mode is StreamMode.GREEN_CONTEXTS and streams.split.generation == 32
    assert streams.emulator.mode is StreamMode.GREEN_CONTEXTS
    assert streams.resplit(48) and streams.emulator.split.generation == 48
    assert not streams.resplit(48)
    with streams.generation(), streams.training():
        assert streams.publish() is None
    assert EmulatedStreams.of(EmulatedDevice(FAST)).mode is StreamMode.PRIORITY_STREAMS
    cpu = EmulatedStreams.of(EmulatedDevice(FAST), "cpu")  # no streams on a device: one stream
    assert cpu.mode is StreamMode.ONE_STREAM and cpu.split is None and not cpu.resplit(48)


def _run(mode=None, **cfg):
    policy = emulated(small_policy(), FAST)
    resources = {"epoch_s": 0.2} | ({"gpu_streams": mode} if mode else {})
    trainer = ebrl.Trainer(env_fn=lambda i: MockEnv(dim=3, episode_len=20, latency=Latency.constant(0.001)),
                           policy=policy, algo=PPO(minibatch_size=64, update_epochs=1),
                           config=ebrl.RunConfig(num_envs=4, segment_len=16, total_env_steps=1200,
                                                 resources=resources, **cfg))
    return ebrl.run_sync(trainer), policy


def test_a_run_on_green_contexts_generates_and_trains_on_the_device_and_the_controller_splits_its_sms(monkeypatch):
    """The split rule reads each window's busy shares, measured in real 0.2 s windows: how they
    come out depends on the machine's load (training's share is CPU work too). So here the rule
    sees every window as generation busy all of it and training a quarter (what it does with
    measured windows: test_resources.py's sm_split_rule test; how the split pays off: ``ebrl
    bench paper-regime``): the controller must then move SMs to generation, in the run, on the
    emulated device, whatever the load."""
    from ebrl.runtime.resources import controller
    from ebrl.runtime.resources.rules_stages import sm_split_rule

    def sm_split_on_a_fixed_window(profile, knobs, limits, memory):
        window = replace(profile, gen_busy_s=profile.window_s, learner_busy_s=profile.window_s / 4)
        return sm_split_rule(window, knobs, limits, memory)

    for rules in ("RULES", "STALL_RULES"):
        monkeypatch.setattr(controller, rules, tuple(sm_split_on_a_fixed_window if r is sm_split_rule else r
                                                     for r in getattr(controller, rules)))
    result, policy = _run("green-contexts")
    assert result.accounting_ok() and result.dropped == {} and result.updates >= 2
    start = {d["knob"]: d for d in result.decisions if d["epoch"] < 0}
    assert start["learner"]["new"] == "thread" and "emulated device test" in start["learner"]["reason"]
    assert start["offload"]["new"] == "thread"  # a call waits for the device: never on the event loop
    assert not [d for d in result.decisions if d["knob"] == "offload" and d["epoch"] >= 0]
    # generation on a quarter of the SMs (32) using all of them, training three quarters of its 96:
    # in proportion that is 73 SMs for generation, and a move goes at most as far as a doubling;
    # the rule moves once two windows want it (epochs 0 and 1; the first window is start-up)
    splits = [d for d in result.decisions if d["knob"] == "gen_sms"]
    assert splits and (splits[0]["epoch"], splits[0]["old"], splits[0]["new"]) == (1, 32, 64)
    assert "in proportion" in splits[0]["reason"]
    # the device runs the last split the controller made (a trial it undid, on the run's
    # measured env steps/s, included)
    assert policy.emulator.split.generation == splits[-1]["new"]
    device = policy.emulator
    assert device.busy_s["generation"] > 0 and device.busy_s["training"] > 0
    assert any("gpu0_sm_util" in p["system"] for p in result.profiles)  # the profiler reads the device


def test_the_default_shares_the_device_on_priority_streams_and_makes_no_split_decision():
    for mode in (None, "one-stream"):
        result, policy = _run(mode)
        assert result.accounting_ok() and not [d for d in result.decisions if d["knob"] == "gen_sms"]
        assert policy.emulator.mode == (mode or "priority-streams") and policy.emulator.split is None
    with pytest.raises(ConfigError, match="emulated device"):
        _run("one-stream", learner="process")
    with pytest.raises(ConfigError, match="resources.gpu_streams"):
        _run("split")


def test_the_first_gpu_run_skips_without_cuda_and_the_comparison_reads_gpu_pi0s_json(tmp_path):
    import importlib.util
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(["bash", str(root / "bench" / "gpu_first_run.sh")], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable})
    assert done.returncode == 0 and "CUDA is not available" in done.stdout
    spec = importlib.util.spec_from_file_location("emulator_vs_gpu", root / "bench" / "emulator_vs_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    measured = tmp_path / "gpu_pi0.json"
    measured.write_text(json.dumps({"results": [{"path": "/tmp/pi0", "act_ms": {"8": 100.0, "1": 49.4},
                                                 "update_s": 0.5}]}))
    assert module.main([str(measured), "--out", str(tmp_path / "cmp.json")]) == 0
    rows = json.loads((tmp_path / "cmp.json").read_text())["rows"]
    assert [(r["call"], r["batch"]) for r in rows] == [("act", 1), ("act", 8), ("train step (LoRA)", 64)]
    assert rows[0]["measured/modelled"] == pytest.approx(49.4 / (PROFILES["pi0-h200"].act_s(1) * 1e3))


def test_the_gpu_twin_calibrates_a_profile_runs_real_and_emulated_and_compares_them(tmp_path):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "paper_regime_gpu.py"
    spec = importlib.util.spec_from_file_location("paper_regime_gpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "twin.json"
    # the emulated runs replay the costs the calibration measures, so this test's time is the
    # machine's load times its runs: one segment a run (one update), and one torch thread (on a
    # busy machine several threads' spin-waits made the tiny model's call take seconds)
    module.SEGMENTS = 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert module.main(["--tiny", "--device", "cpu", "--env", "mock", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads(out.read_text())
    assert [(r["kind"], r["schedule"]) for r in report["runs"]] == [
        ("real", "async"), ("real", "sync"), ("emulated", "sync"), ("emulated", "async")]
    assert all(r["accounting_ok"] and r["env_steps"] == 2 * 8 * 1 and r["updates"] == 1 for r in report["runs"])
    profile = report["profile"]  # the tiny model's own costs, fitted as the published figures are
    calibration = report["calibration"]
    assert set(calibration["act_s"]) == {"1", "4", "8"} and set(calibration["train_step_s"]) == {"4", "8"}
    assert min(profile[k] for k in ("act_fixed_s", "act_per_row_s", "train_fixed_s", "train_per_sample_s")) >= 0
    assert profile["act_fixed_s"] + profile["act_per_row_s"] > 0
    assert set(report["emulated/real"]) == {"async", "sync"} and all(v > 0 for v in report["emulated/real"].values())
