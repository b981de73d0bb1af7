"""Generation next to training on one GPU: one stream, two priority streams, green-context splits.

Two threads run at once for a fixed time: generation (a policy forward at batch 64, its actions
copied to the host, one after another: the latency an env waits for) and training (a small CNN
on 84x84x3 batches of 128, backward and an Adam step, synchronised each step). Every few training
steps the trainer publishes a CUDA event and generation waits on it, as at weight publication.
Configurations (:class:`ebrl.runtime.resources.gpu.GpuStreams`): ``one-stream``,
``priority-streams``, and for generation SM counts 8, 16, 32 (where the device has room)
``green-N`` (both sides on green contexts) and ``green-train-N`` (training alone confined to
``total - N`` SMs, generation on a high-priority stream); plus each side alone for reference.
A configuration whose mode falls back is not measured (its reason is in ``meta["fallbacks"]``); one
that raises while measured is dropped from later rounds (``meta["errors"]``).

Per configuration and round: generation latency median and p95 (ms), generation forwards/s,
training steps/s, and for the generic table env steps/s (forwards x 64: the actions served)
with its µs per env step; 3 alternating rounds (``--quick``: 1), medians with min-max; ratios
within each round against ``one-stream``; training alone in ``meta``. Without CUDA no stream
mode is measured and the report says so; its one row is a short run of the two threads on the
CPU (the fallback), so the report still has a real row."""

from __future__ import annotations

import statistics
import threading
import time

from ebrl.benchmark.figures import round_ratios, spread, summarize_rows
from ebrl.runtime.resources.gpu import GpuStreams, StreamMode

DESCRIPTION = "generation latency and training steps/s on one stream, priority streams and green-context SM splits"
GEN_SMS = (8, 16, 32)
BATCH, TRAIN_BATCH, OBS_DIM, ACT_DIM = 64, 128, 64, 8
PUBLISH_EVERY = 10  # training steps
FIELDS = ("steps_per_s", "us_per_step", "gen_latency_ms_p50", "gen_latency_ms_p95", "gen_forwards_per_s",
          "train_steps_per_s")


def nets(torch, device):
    nn = torch.nn

    def cnn(out: int):
        return nn.Sequential(nn.Conv2d(3, 32, 8, 4), nn.ReLU(), nn.Conv2d(32, 64, 4, 2), nn.ReLU(),
                             nn.Conv2d(64, 64, 3, 1), nn.ReLU(), nn.Flatten(), nn.Linear(64 * 7 * 7, 512), nn.ReLU(),
                             nn.Linear(512, out)).to(device)

    mlp = nn.Sequential(nn.Linear(OBS_DIM, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                        nn.Linear(256, ACT_DIM)).to(device)
    return {"mlp": (mlp, torch.randn(BATCH, OBS_DIM, device=device)),
            "cnn": (cnn(ACT_DIM), torch.randn(BATCH, 3, 84, 84, device=device))}, cnn(1)


def measure(torch, streams, policy, obs, trainer, seconds: float, gen: bool = True, train: bool = True) -> dict:
    """Run generation and/or training on their threads for ``seconds``."""
    stop, latencies, counts, published = threading.Event(), [], {"train": 0}, [None]
    device = obs.device
    opt = torch.optim.Adam(trainer.parameters(), lr=1e-4)
    with streams.training():
        batch = torch.randn(TRAIN_BATCH, 3, 84, 84, device=device)
    sync = (lambda s: s.synchronize()) if streams.training_stream is not None else (lambda s: None)

    def generate():
        with torch.no_grad(), streams.generation():
            while not stop.is_set():
                event, published[0] = published[0], None
                streams.wait_published(event)
                t0 = time.perf_counter()
                policy(obs).cpu()  # waits for the forward: the env's wait for its actions
                latencies.append(time.perf_counter() - t0)

    def training():
        with streams.training():
            while not stop.is_set():
                loss = trainer(batch).square().mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                counts["train"] += 1
                if counts["train"] % PUBLISH_EVERY == 0:
                    published[0] = streams.publish()
                sync(streams.training_stream)

    errors = []

    def guarded(fn):
        def body():
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 (stop both sides; raised after the join)
                errors.append(exc)
                stop.set()
        return body

    threads = [threading.Thread(target=guarded(f), daemon=True) for f, on in ((generate, gen), (training, train))
               if on]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    out = {"wall_s": wall, "train_steps_per_s": counts["train"] / wall if train else None}
    if gen and latencies:
        ms = sorted(x * 1e3 for x in latencies)
        # env steps: each forward answers BATCH envs (the generic table's env steps/s and µs/step)
        p95 = ms[min(len(ms) - 1, int(0.95 * len(ms)))]
        out.update(gen_latency_ms_p50=statistics.median(ms), gen_latency_ms_p95=p95,
                   gen_forwards_per_s=len(ms) / wall, env_steps=len(ms) * BATCH, steps_per_s=len(ms) * BATCH / wall,
                   us_per_step=wall / (len(ms) * BATCH) * 1e6)
    return out


def configurations(total_sms: int, granularity: int) -> list[tuple[str, dict]]:
    out = [("one-stream", {"max_mode": "one-stream"}), ("priority-streams", {"max_mode": "priority-streams"})]
    usable = total_sms // granularity * granularity
    for n in GEN_SMS:
        if n % granularity == 0 and n + granularity <= usable:
            out += [(f"green-{n}", {"gen_sms": n, "layout": "both"}),
                    (f"green-train-{n}", {"gen_sms": n, "layout": "training"})]
    return out


def print_table(summary: dict) -> None:
    for case, runners in summary.items():
        print(f"\ngpu-split / {case}: generation latency p50, p95 (ms), forwards/s, training steps/s")
        for runner, f in runners.items():
            cells = [fmt(f.get(k)) for k in FIELDS[2:]]
            print(f"  {runner:22s} " + "  ".join(f"{c:>22s}" for c in cells))


def fmt(s: dict | None) -> str:
    if not s or not s.get("n"):
        return "n/a"
    return f"{s['median']:.3g}" + ("" if s["n"] == 1 else f" ({s['min']:.3g}-{s['max']:.3g})")


def cpu_fallback(torch, quick: bool) -> dict:
    """No CUDA: one short run of the same two threads on the CPU (``GpuStreams`` mode ``cpu``), so
    the report has a real row, and the message that nothing on a GPU was measured."""
    torch.manual_seed(0)
    streams = GpuStreams.create()
    policies, trainer = nets(torch, torch.device("cpu"))
    row = {"case": "mlp", "round": 0, "runner": "cpu-fallback", **streams.describe(),
           **measure(torch, streams, *policies["mlp"], trainer, 0.5 if quick else 1.0)}
    msg = (f"gpu-split skipped: {streams.fallback_reason} on this host; no stream mode was measured. The one row "
           "is the CPU fallback (both threads on the CPU, no streams), not a GPU figure.")
    print(msg)
    return {"rows": [row], "summary": summarize_rows([row], FIELDS),
            "meta": {"skipped": msg, "rounds": 1, "description": f"{DESCRIPTION}. SKIPPED: {streams.fallback_reason}; "
                     "the one row is the CPU fallback, not a GPU figure"}}


def run(quick: bool = False) -> dict:
    import torch

    if not torch.cuda.is_available():
        return cpu_fallback(torch, quick)
    torch.backends.cudnn.benchmark = True
    device = torch.device("cuda", torch.cuda.current_device())
    rounds, seconds = (1, 0.5) if quick else (3, 3.0)
    probe = GpuStreams.create(device=device.index, max_mode="one-stream")
    fallbacks, built = {}, {}
    for name, kw in configurations(probe.total_sms, probe.granularity):
        streams = GpuStreams.create(device=device.index, **kw)
        if streams.mode is not StreamMode(kw.get("max_mode", "green-contexts")):
            fallbacks[name] = f"{streams.mode}: {streams.fallback_reason}"  # not what its name says: not measured
            continue
        built[name] = streams
    policies, trainer = nets(torch, device)
    torch.cuda.synchronize()  # the weights and inputs exist before other streams read them
    base = built["one-stream"]
    for policy, obs in policies.values():  # untimed warm-up (cuDNN's algorithm search, the allocator)
        measure(torch, base, policy, obs, trainer, 0.2 if quick else 1.0)
    rows, training_alone, errors = [], {case: [] for case in policies}, {}
    for r in range(rounds):  # alternating: every configuration once per round
        for case, (policy, obs) in policies.items():
            rows.append({"case": case, "round": r, "runner": "generation-alone",
                         **measure(torch, base, policy, obs, trainer, seconds, train=False)})
            training_alone[case].append(measure(torch, base, policy, obs, trainer, seconds, gen=False)
                                        ["train_steps_per_s"])
            for name, streams in list(built.items()):
                try:
                    figures = measure(torch, streams, policy, obs, trainer, seconds)
                except Exception as exc:  # noqa: BLE001 (e.g. an event across green contexts: report, go on)
                    errors[name] = f"{case}, round {r}: {type(exc).__name__}: {exc}"
                    print(f"gpu-split: {name} failed, not measured further: {errors[name]}")
                    torch.cuda.synchronize()
                    del built[name]
                    continue
                rows.append({"case": case, "round": r, "runner": name, **streams.describe(), **figures})
    summary = summarize_rows(rows, FIELDS)
    ratios = {}
    for case in policies:
        for name in dict.fromkeys(r["runner"] for r in rows if r["case"] == case):
            if name not in ("one-stream", "generation-alone"):
                ratios[f"{case}: train steps/s {name}/one-stream"] = round_ratios(
                    rows, case, name, ["one-stream"], "train_steps_per_s")
                ratios[f"{case}: gen p50 latency one-stream/{name}"] = round_ratios(
                    rows, case, "one-stream", [name], "gen_latency_ms_p50")
    print_table(summary)
    for case, values in training_alone.items():
        print(f"  {case}: training alone {fmt(spread(values))} steps/s")
    props = torch.cuda.get_device_properties(device)
    return {"rows": rows, "summary": summary, "ratios": ratios,
            "meta": {"rounds": rounds, "seconds_per_run": seconds, "gpu": props.name, "total_sms": probe.total_sms,
                     "granularity": probe.granularity, "torch_cuda": torch.version.cuda, "fallbacks": fallbacks,
                     "errors": errors,
                     "training_alone_steps_per_s": {c: spread(v) for c, v in training_alone.items()},
                     "streams": {name: s.describe() for name, s in built.items()}, "batch": BATCH,
                     "train_batch": TRAIN_BATCH}}
