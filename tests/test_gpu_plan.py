"""The SM split rule and the stream fallbacks of :mod:`ebrl.runtime.resources.gpu`, with a fake
torch (no GPU needed), and the real torch of a CPU host."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest

from ebrl.runtime.resources.gpu import (GpuStreams, SmSplit, StreamMode, clamp_split, plan_sm_split, sm_granularity,
                                        start_split)

def plan(gen_now, gen_busy, train_busy, total=132, **kw):
    return plan_sm_split(total, gen_now, gen_busy, train_busy, **kw)


# --- plan_sm_split ------------------------------------------------------------------------------

def test_default_start_is_a_quarter_of_the_sms_in_granules():
    s = start_split(132)
    assert (s.generation, s.training) == (32, 96) and "default" in s.reason
    assert plan(0, 1.0, 0.2).generation == 32  # no split yet: the start, whatever was measured
    assert start_split(78).generation == 16  # 72 usable / 4 = 18 -> nearest granule
    assert start_split(40, granularity=4).generation == 12  # 40 / 4 = 10 -> nearest multiple of 4


@pytest.mark.parametrize("gen_busy", [0.8, 0.0])
def test_a_window_without_training_holds(gen_busy):
    s = plan(48, gen_busy, 0.0)
    assert s.generation == 48 and "training did not run" in s.reason


def test_a_window_of_training_alone_halves_generation_down_to_one_granule():
    assert plan(48, 0.0, 1.0).generation == 24
    assert plan(16, 0.0, 0.5).generation == 8
    assert plan(8, 0.0, 1.0).generation == 8


def test_splits_in_proportion_to_each_sides_sm_seconds():
    # generation half busy on 32 SMs (16 SM-s/s), training saturated on 96 (96): 128 * 16/112 = 18.3 -> 16
    assert plan(32, 0.5, 1.0).generation == 16
    # training a third busy on 64 SMs (21), generation saturated on 64 (64): 128 * 64/85 = 96
    assert plan(64, 1.0, 1 / 3).generation == 96


def test_both_sides_saturated_or_proportional_already_holds():
    for gen_busy, train_busy in [(1.0, 1.0), (0.5, 0.5), (0.9, 0.95)]:
        s = plan(32, gen_busy, train_busy)
        assert s.generation == 32 and "holding" in s.reason


def test_a_wanted_move_under_one_granule_holds():
    # 128 * (0.8*32) / (0.8*32 + 96) = 26.9: 5 SMs from 32, under a granule of 8
    assert plan(32, 0.8, 1.0).generation == 32
    assert plan(32, 0.8, 1.0, granularity=4).generation == 28  # a granule of 4: it moves


def test_a_move_is_at_most_a_doubling_or_a_halving():
    assert plan(16, 1.0, 0.01).generation == 32
    assert plan(64, 0.01, 1.0).generation == 32


def test_bounds_say_so_in_the_reason():
    s = plan(64, 1.0, 0.02)
    assert s.generation == 120 and s.training == 8 and "maximum" in s.reason  # training keeps one granule
    s = plan(16, 0.02, 1.0)
    assert s.generation == 8 and "minimum" in s.reason  # generation keeps one granule


@pytest.mark.parametrize("total", [16, 24, 78, 108, 132, 144])
@pytest.mark.parametrize("gen_now,gen_busy,train_busy",
                         [(0, 0.0, 0.0), (8, 1.0, 0.1), (40, 0.1, 1.0), (64, 0.3, 0.9), (200, 1.0, 0.5), (13, 0.5, 0.5)])
def test_both_sides_are_granule_multiples_of_at_least_one_granule(total, gen_now, gen_busy, train_busy):
    s = plan(gen_now, gen_busy, train_busy, total=total)
    assert s.generation % 8 == 0 and s.training % 8 == 0
    assert s.generation >= 8 and s.training >= 8 and s.generation + s.training <= total


def test_min_sms_and_too_few_sms():
    assert plan(16, 0.01, 1.0, min_sms=16).generation == 16  # will not go below min_sms
    with pytest.raises(ValueError):
        start_split(12)  # cannot hold two granules of 8
    with pytest.raises(ValueError):
        plan(8, 1.0, 1.0, total=12)


def test_split_is_frozen_and_clamped():
    s = clamp_split(132, 13)
    assert s == SmSplit(16, 112, "requested")
    with pytest.raises(AttributeError):
        s.generation = 8


def test_sm_granularity():
    assert sm_granularity(9, 0) == 8 and sm_granularity(10, 0) == 8 and sm_granularity(12, 1) == 8
    assert sm_granularity(8, 6) == 4 and sm_granularity(7, 5) == 2 and sm_granularity(6, 1) == 1


# --- a fake torch -------------------------------------------------------------------------------

class FakeStream:
    range = (0, -5)  # torch's order: (least priority, greatest priority)

    def __init__(self, device=None, priority=0, owner=None):
        self.device, self.priority, self.owner = device, priority, owner
        self.recorded, self.waited, self.synced = [], [], 0

    @classmethod
    def priority_range(cls):
        return cls.range

    def wait_event(self, event):
        self.waited.append(event)

    def synchronize(self):
        self.synced += 1


class FakeEvent:
    def record(self, stream):
        stream.recorded.append(self)


def fake_torch(cuda=True, green="works", sms=132, cc=(9, 0)):
    """``green``: "works", "missing" (no attribute) or "raises"."""
    created, entered = [], []

    class FakeGreenContext:
        def __init__(self, num_sms, device_id):
            self.num_sms, self.device_id = num_sms, device_id

        @staticmethod
        def create(*, num_sms=None, device_id=None, **kw):
            if green == "raises":
                raise RuntimeError("PyTorch was not built with Green Context support!")
            ctx = FakeGreenContext(num_sms, device_id)
            created.append(ctx)
            return ctx

        def Stream(self):  # torch's name
            return FakeStream(self.device_id, owner=self)

    @contextlib.contextmanager
    def stream(s):
        entered.append(s)
        yield

    ns = SimpleNamespace(
        is_available=lambda: cuda, current_device=lambda: 0, Stream=FakeStream, Event=FakeEvent, stream=stream,
        get_device_properties=lambda i: SimpleNamespace(multi_processor_count=sms, major=cc[0], minor=cc[1]))
    if green != "missing":
        ns.GreenContext = FakeGreenContext
    return SimpleNamespace(cuda=ns, created=created, entered=entered)


# --- GpuStreams.create fallbacks ----------------------------------------------------------------

def test_no_cuda_is_cpu_mode():
    t = fake_torch(cuda=False)
    s = GpuStreams.create(torch_module=t)
    assert s.mode is StreamMode.CPU and s.fallback_reason == "CUDA is not available"
    assert s.generation_stream is None and s.training_stream is None and s.publish() is None
    with s.generation(), s.training():
        pass
    assert t.entered == []


def test_no_green_context_attribute_gives_priority_streams_generation_higher():
    t = fake_torch(green="missing")
    s = GpuStreams.create(torch_module=t)
    assert s.mode is StreamMode.PRIORITY_STREAMS
    assert s.fallback_reason == "torch has no torch.cuda.GreenContext"
    # CUDA: a lower number is a higher priority; priority_range() is (least, greatest) = (0, -5)
    assert s.generation_stream.priority == -5 and s.training_stream.priority == 0
    assert s.generation_stream is not s.training_stream and s.priorities == (-5, 0)
    assert s.total_sms == 132 and s.split is None


def test_priorities_do_not_depend_on_the_order_priority_range_returns(monkeypatch):
    monkeypatch.setattr(FakeStream, "range", (-1, 0))
    s = GpuStreams.create(torch_module=fake_torch(green="missing"))
    assert s.generation_stream.priority == -1 and s.training_stream.priority == 0


def test_green_context_create_raising_falls_back_with_the_reason():
    s = GpuStreams.create(torch_module=fake_torch(green="raises"))
    assert s.mode is StreamMode.PRIORITY_STREAMS
    assert s.fallback_reason == ("GreenContext.create raised RuntimeError: "
                                 "PyTorch was not built with Green Context support!")
    assert s.describe()["fallback_reason"] == s.fallback_reason


def test_too_few_sms_for_a_split_falls_back():
    s = GpuStreams.create(torch_module=fake_torch(sms=12))
    assert s.mode is StreamMode.PRIORITY_STREAMS and "no green-context split" in s.fallback_reason


def test_working_green_contexts():
    t = fake_torch()
    s = GpuStreams.create(device="cuda:1", torch_module=t)
    assert s.mode is StreamMode.GREEN_CONTEXTS and s.fallback_reason == ""
    assert sorted(c.num_sms for c in t.created) == [32, 96]  # default start: a quarter to generation
    assert {c.device_id for c in t.created} == {1} and s.device == 1
    assert s.generation_stream.owner.num_sms == 32 and s.training_stream.owner.num_sms == 96
    assert (s.split.generation, s.split.training) == (32, 96)
    with s.generation():
        pass
    with s.training():
        pass
    assert t.entered == [s.generation_stream, s.training_stream]
    d = s.describe()
    assert d["mode"] == "green-contexts" and d["gen_sms"] == 32 and d["train_sms"] == 96 and d["layout"] == "both"


def test_green_contexts_with_requested_sms_and_granularity():
    t = fake_torch(sms=108, cc=(8, 0))  # A100: 108 SMs, granularity 4
    s = GpuStreams.create(gen_sms=14, torch_module=t)
    assert s.granularity == 4 and sorted(c.num_sms for c in t.created) == [16, 92]


def test_training_only_layout_confines_training_and_keeps_generation_on_a_priority_stream():
    t = fake_torch()
    s = GpuStreams.create(gen_sms=16, torch_module=t, layout="training")
    assert s.mode is StreamMode.GREEN_CONTEXTS
    assert [c.num_sms for c in t.created] == [112]
    assert s.generation_stream.owner is None and s.generation_stream.priority == -5
    assert s.training_stream.owner.num_sms == 112


def test_max_mode_caps_the_richness():
    s = GpuStreams.create(torch_module=fake_torch(), max_mode="priority-streams")
    assert s.mode is StreamMode.PRIORITY_STREAMS and s.split is None
    s = GpuStreams.create(torch_module=fake_torch(), max_mode=StreamMode.ONE_STREAM)
    assert s.mode is StreamMode.ONE_STREAM and s.generation_stream is s.training_stream
    assert s.fallback_reason == "one-stream mode requested"
    assert GpuStreams.create(torch_module=fake_torch(), max_mode="cpu").mode is StreamMode.CPU


def test_publish_records_on_training_and_generation_waits():
    s = GpuStreams.create(torch_module=fake_torch(green="missing"))
    event = s.publish()
    assert isinstance(event, FakeEvent)
    assert s.training_stream.recorded == [event] and s.generation_stream.recorded == []
    s.wait_published(event)
    assert s.generation_stream.waited == [event] and s.training_stream.waited == []
    s.wait_published(None)
    assert s.generation_stream.waited == [event]


def test_resplit_recreates_the_contexts():
    t = fake_torch()
    s = GpuStreams.create(torch_module=t)
    old_gen, old_train = s.generation_stream, s.training_stream
    assert s.resplit(48) is True
    assert [c.num_sms for c in t.created[2:]] == [80, 48]  # training first, then generation
    assert old_gen.synced == 1 and old_train.synced == 1  # waited for the old streams' work
    assert s.generation_stream.owner.num_sms == 48 and s.training_stream.owner.num_sms == 80
    assert s.split.generation == 48 and s.split.training == 80
    assert s.resplit(45) is False and len(t.created) == 4  # 45 rounds up to 48: no change
    assert s.resplit(1000) is True and s.split == SmSplit(120, 8, "resplit")  # clamped


def test_resplit_only_in_green_mode():
    s = GpuStreams.create(torch_module=fake_torch(green="missing"))
    assert s.resplit(48) is False and s.split is None


# --- the real torch (a CPU build here) ----------------------------------------------------------

def test_real_torch_on_this_host_without_cuda():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: the CPU-fallback check needs a host without it (the fakes cover the rest)")
    s = GpuStreams.create()
    assert s.mode is StreamMode.CPU and s.fallback_reason == "CUDA is not available"
    with s.generation():
        x = torch.ones(3) * 2
    with s.training():
        y = x + 1
    assert y.tolist() == [3.0, 3.0, 3.0]
    assert s.publish() is None
    s.wait_published(None)
    assert s.describe()["mode"] == "cpu" and s.resplit(16) is False
