"""Sample efficiency: env steps and wall time to success 0.8, on-policy PPO against off-policy
learning (issue 64, item 6): SAC, RLPD with demonstrations, and DSRL steering a frozen flow policy.

Every run is in a fresh Python process (``--in-process``: all in the bench's own), 3 seeds,
runners alternating within a seed. A run stops when its success first reaches 0.8, at its step
budget, or at its wall-time cap, whichever comes first. Success is the runtime's
``success_once`` (the share of the last 100 training episodes that succeeded at some step, read
after every update), counted once 100 episodes have ended (a window of a few first episodes
is not a success rate): the same window for every runner, which delays every runner's
crossing by up to 100 episodes and so compresses the ratios of fast learners. Reported per
case and runner:

- *env steps to 0.8* (decisions on ``flow-dsrl``, each up to 4 env steps) and *seconds to 0.8*
  from the run's start (env builds included), or "not reached";
- *final success*: at the stop (the threshold, the budget or the cap);
- ``<case>: ppo/<runner>``: PPO's env steps to 0.8 over the off-policy runner's, per seed. Where
  PPO did not reach 0.8 its whole run stands in (a lower bound, counted in ``lower_bounds``);
  a seed where the off-policy runner did not reach it gives no ratio (``not_reached``).

Cases (every algorithm at its defaults except where said; never tuned to the target):

- ``fetchreach``: gymnasium-robotics ``FetchReachDense-v4`` from state (flattened), 16 envs.
  PPO as the convergence suite runs it (``MLPPolicy``, segments of 50, minibatches of 512);
  SAC on ``MLPPolicy(action_head="squashed")``, streamed (its default under async: the learner
  takes every step recorded since its last update; ``segment_len`` at RunConfig's 64) and every
  ``SACConfig`` default (``learning_starts`` 1000, UTD 1, batch 256). Both on
  the dense reward, the same env for both runners: SAC needs no sparse reward here (an
  exploratory run reached success 0.84 at 10,469 env steps on the dense one).
- ``pushcube``: ManiSkill3 ``PushCube-v1`` from state on SAPIEN's CPU backend, 50-step
  episodes, ManiSkill's dense reward, ``control_mode="pd_ee_delta_pos"`` for every runner: the
  scripted expert that records RLPD's demonstrations drives the end effector
  (``ebrl.demos.experts``), and the demonstrations' actions must be the env's. PPO with
  ``gamma=0.8`` (ManiSkill's own PPO baseline for its 50-step tasks, as the convergence suite),
  segments of 50; SAC as on fetchreach; RLPD (``RLPDConfig``: LayerNorm critics, an ensemble of
  10, ``learning_starts`` 5000, half of each minibatch from the demonstrations) with
  ``RLPD_SETTINGS`` (UTD 1, SAC's, not RLPD's 20: at 20, the first update after
  ``learning_starts``, 2,560 gradient steps of about 65 ms for one segment of 16 envs x 8 steps,
  ran 190 s past a 30-second cap, as no cap stops an update), streamed, and 20 scripted
  demonstrations per seed (``ebrl.demos.collect``, seeds ``DEMO_SEED + 1000 * seed``; they end
  at success, so about 12 steps each).
- ``flow-dsrl``: a chunked :class:`~ebrl.policies.FlowPolicy` (K=4, its default sizes)
  pretrained by SFT (:func:`ebrl.sft.sft`, ``SFTConfig`` defaults) on ``DEMOS`` noisy episodes
  of a scripted expert (its actions plus Gaussian noise of std ``DEMO_NOISE``) of
  :func:`ring_reach`, a 2-D kinematic reach (:class:`ebrl.testing.RingReach`, the ring-2d of
  ``tests/test_learning_reach.py``, with success: within ``RING_TOLERANCE`` of the target at some
  step), in virtual time
  (:func:`ebrl.testing.run_virtual`: the step counts repeat whatever the machine's load; the
  seconds are this process's real ones). Then PPO fine-tunes the whole flow policy (Flow-Noise;
  16 envs x 32 decisions and minibatches of 128, as tests/test_learning_reach.py trains
  FlowPolicy; observation statistics frozen at SFT's, as ``ebrl train`` does from
  ``policy.init``; the flow's ``init_sigma`` 0.1, the range its docstring gives for fine-tuning a
  pretrained flow, where the default 0.5 is for PPO from scratch), against DSRL
  (:class:`~ebrl.policies.dsrl.DSRLPolicy` on the frozen SFT policy, its defaults; SAC at its
  defaults, streamed). The same SFT weights start both runners of a seed.
  Issue 64 item 4's cost: DSRL's flow forward per decision (``DSRLPolicy.act``) against PPO's
  forward plus forward-and-backward per decision (``FlowPolicy.act``, then ``update_epochs``
  passes of ``evaluate`` and ``backward``), timed in one process on one torch thread at batch
  sizes ``COST_BATCHES`` (``cost`` rows).

Target (issue 64): an off-policy runner reaches success 0.8 in at most 1/3 of PPO's env steps
(``ppo/<runner> >= 3``) on at least two of the three cases. A ratio counts only where the
off-policy runner reached 0.8 in every seed.

Sizing: 3 seeds of every case fit 20 minutes on a 2-core machine (issue 64's rule); each
runner's step budget and wall cap are in ``CASES``, and a runner that does not reach 0.8 within
them is reported as not reached. On a 2-core CPU (one torch thread, as the runtime sets) what
bounds the off-policy runners is their gradient steps: SAC's (two 256x256 critics, batch 256)
took about 15 ms each, RLPD's (ten LayerNorm critics) about 65 ms, so SAC runs at under 100 env
steps/s. Exploratory runs (seed 0, a test suite running beside them): SAC on fetchreach reached
0.8 at 10,469 env steps in 180 s; PushCube on SAPIEN's CPU backend took 15-20 s to build 16
envs and then stepped about 150-200 env steps/s, so a 30-second run holds a few thousand env
steps: no runner can reach 0.8 on it within this budget (``ebrl bench embodied-learning``'s
PPO, joint control, reached it after 89,000-129,000 env steps, 140-225 s a run), and RLPD
barely reaches its ``learning_starts``; the pushcube rows say how far each got, not how fast it
learns. On flow-dsrl, PPO held success near 0.45 for 60,000 decisions, and DSRL rose from 0.5
to 0.7 in 8,000 decisions (175 s). ``EBRL_SAMPLE_EFFICIENCY_SCALE=N`` multiplies every budget
and cap by N, for a machine or a day with more time. ``--quick`` is a smoke test: 1 seed, a few
hundred steps, 2-4 envs, tiny sizes.
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import gymnasium as gym
import numpy as np

from ebrl.benchmark.figures import Target, check_targets, spread

DESCRIPTION = ("env steps and seconds to success 0.8: PPO vs SAC (FetchReach), vs SAC and RLPD + 20 demos (PushCube), "
               "PPO vs DSRL on an SFT flow policy (virtual time); 3 seeds")
SEEDS = (0, 1, 2)
THRESHOLD = 0.8  # success_once
WINDOW = 100  # episodes in the runtime's success_once window: a score counts once it is full
TARGET = 3.0  # PPO's env steps to the threshold over the off-policy runner's
CASES_NEEDED = 2  # of the three cases
RLPD_SETTINGS = (("utd_ratio", 1.0),)  # the module docstring says why not RLPD's 20
FETCH_REWARD = "dense"  # the same reward for both runners; SAC learns on it (the module docstring)
PUSHCUBE_DEMOS = 20
# flow-dsrl: the demonstrations SFT clones, and the timing of a decision
DEMOS, DEMO_NOISE, K = 40, 0.3, 4
COST_BATCHES = (16, 256)
VIRTUAL_STEP_S = 0.001  # ring_reach's declared step cost in virtual time: the progress check's clock
VIRTUAL_LOG_S = 0.05  # virtual seconds between stop checks (about 200 decisions of 16 envs)


# ---- envs -----------------------------------------------------------------------------------

def fetchreach_env(i: int) -> gym.Env:
    from ebrl.envs.robotics import make_robotics

    return make_robotics("FetchReachDense-v4" if FETCH_REWARD == "dense" else "FetchReach-v4")


def pushcube_env(i: int) -> gym.Env:
    from ebrl.envs import make

    return make("maniskill/PushCube-v1", control_mode="pd_ee_delta_pos")


RING_TOLERANCE = 0.02  # flow-dsrl's success: within this of the target at some step of the episode


def ring_reach() -> gym.Env:
    """:class:`ebrl.testing.RingReach` as flow-dsrl runs it: ``info["success"]`` once the point
    has been within ``RING_TOLERANCE`` of the target at some step of the episode (sticky, so that
    a chunk's last step reports it), each step declared ``VIRTUAL_STEP_S``. The episode does not
    end there: with a negative reward, an end at success is worth avoiding to SAC while its
    entropy bonus outweighs the reward (exploration found DSRL driving success from 0.5 to 0.05
    that way)."""
    from ebrl.testing import RingReach

    return RingReach(tolerance=RING_TOLERANCE, sticky=True, virtual_step_cost=VIRTUAL_STEP_S)


def ring_env(i: int) -> gym.Env:
    from ebrl.envs.chunks import ActionChunk

    return ActionChunk(ring_reach(), K)


# ---- cases ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Runner:
    steps: int  # env steps (decisions on flow-dsrl) a run may take
    max_s: float  # its wall-time cap
    segment_len: int
    settings: tuple[tuple[str, object], ...] = ()  # the algorithm's settings other than its defaults
    quick_steps: int = 256
    quick_settings: tuple[tuple[str, object], ...] = ()  # --quick: small enough to take a gradient step


@dataclass(frozen=True)
class Case:
    env_fn: object
    num_envs: int
    runners: dict[str, Runner] = field(default_factory=dict)  # "ppo" first
    virtual: bool = False
    quick_envs: int = 4


QUICK_SAC = (("learning_starts", 32), ("batch_size", 32))
CASES = {
    "fetchreach": Case(fetchreach_env, 16, {
        "ppo": Runner(150_000, 45.0, 50, (("minibatch_size", 512),), quick_steps=200),
        "sac": Runner(30_000, 150.0, 64, quick_steps=128, quick_settings=QUICK_SAC)}),
    "pushcube": Case(pushcube_env, 16, {
        "ppo": Runner(200_000, 30.0, 50, (("gamma", 0.8),), quick_steps=100),
        "sac": Runner(30_000, 30.0, 64, quick_steps=64, quick_settings=QUICK_SAC),
        "rlpd": Runner(30_000, 30.0, 64, RLPD_SETTINGS, quick_steps=64,
                       quick_settings=(*QUICK_SAC, ("utd_ratio", 1.0), ("num_critics", 2)))},
        quick_envs=2),
    "flow-dsrl": Case(ring_env, 16, {
        "ppo": Runner(15_000, 30.0, 32, (("minibatch_size", 128),), quick_steps=128),
        "dsrl": Runner(10_000, 45.0, 64, quick_steps=128, quick_settings=QUICK_SAC)}, virtual=True),
}


def scale() -> float:
    """``EBRL_SAMPLE_EFFICIENCY_SCALE``: every full run's step budget and wall cap times this (1:
    the 20-minute suite; more on a machine or a day with more time)."""
    import os

    return float(os.environ.get("EBRL_SAMPLE_EFFICIENCY_SCALE", "1"))


# ---- one run --------------------------------------------------------------------------------

class WallClock:
    """An algorithm whose every update's metrics carry this process's seconds since ``t0``: the
    wall time of a run in virtual time, whose loop clock is not the wall's."""

    t0 = 0.0

    def update(self, policy, batch):
        out = super().update(policy, batch)
        out["wall_clock_s"] = time.perf_counter() - self.t0
        return out


def _algo(name: str, settings: dict, seed: int, virtual: bool):
    from ebrl.algos import PPO, RLPD, SAC

    cls = {"ppo": PPO, "sac": SAC, "dsrl": SAC, "rlpd": RLPD}[name]
    if virtual:
        cls = type(f"Timed{cls.__name__}", (WallClock, cls), {})
    return cls(seed=seed, **settings)


def _flow_policy(spaces, seed: int, quick: bool):
    from ebrl.policies import FlowPolicy

    sizes = {"hidden": (32, 32), "noise_hidden": (16,), "critic_hidden": (32, 32)} if quick else {}
    return FlowPolicy.from_spaces(*spaces, init_sigma=0.1, seed=seed, **sizes)


def _policy(case: str, name: str, spaces, seed: int, quick: bool, sft_path: str | None):
    import torch

    from ebrl.policies import MLPPolicy

    if case != "flow-dsrl":
        head = {} if name == "ppo" else {"action_head": "squashed"}
        return MLPPolicy.from_spaces(*spaces, seed=seed, **head)
    flow = _flow_policy(spaces, seed, quick)
    flow.load_state_dict(torch.load(sft_path, weights_only=True))
    flow.freeze_obs_stats()  # the statistics SFT's weights were fitted to (ebrl train from policy.init)
    if name == "ppo":
        return flow
    from ebrl.policies.dsrl import DSRLPolicy

    return DSRLPolicy(flow, seed=seed, **({"hidden": (32, 32)} if quick else {}))


def measure_run(case: str, runner: str, seed: int, quick: bool, sft_path: str | None = None) -> dict:
    """One run, ``{"curve": [...], "out": {...}}``: what a fresh process
    (``call_fresh("suite:sample-efficiency:measure_run", ...)``) computes."""
    import asyncio

    import ebrl
    from ebrl.benchmark.suite import run_capped
    from ebrl.runtime.sim.stepping import single_spaces
    from ebrl.testing import run_virtual

    c, r = CASES[case], CASES[case].runners[runner]
    probe = c.env_fn(0)
    spaces = single_spaces(probe)
    probe.close()
    policy = _policy(case, runner, spaces, seed, quick, sft_path)
    settings = {**dict(r.settings), **(dict(r.quick_settings) if quick else {})}
    algo = _algo(runner, settings, seed, c.virtual)
    extra = {}
    if runner == "rlpd":
        extra = _load_pushcube_demos(algo, spaces, seed, quick)
    num_envs = min(c.num_envs, c.quick_envs) if quick else c.num_envs
    steps, max_s = (r.quick_steps, 300.0) if quick else (int(r.steps * scale()), r.max_s * scale())

    def until(row: dict) -> bool:
        return _counts({"score": row.get("success_once"), "episodes": row.get("episodes", 0)})

    cfg = ebrl.RunConfig(num_envs=num_envs, segment_len=r.segment_len, total_env_steps=steps, seed=seed,
                         log_every_s=VIRTUAL_LOG_S if c.virtual else 1.0)
    trainer = ebrl.Trainer(c.env_fn, policy, algo, cfg)
    t0 = time.perf_counter()
    if c.virtual:  # the loop's clock is virtual: the stop checks read the process's own
        algo.t0 = t0
        stop = asyncio.Event()

        def progress(stats, learner) -> None:
            if (learner.history and until(learner.history[-1])) or time.perf_counter() - t0 > max_s:
                stop.set()

        result = run_virtual(trainer, stop=stop, progress=progress)
    else:
        result = run_capped(trainer, max_s, until=until)
    wall = time.perf_counter() - t0
    curve = [{"time": h["wall_clock_s"] if c.virtual else h["time"], "env_steps": h["env_steps"],
              "score": h.get("success_once"), "episodes": h.get("episodes", 0)} for h in result.history]
    out = {"env_steps": result.env_steps, "wall_s": wall, "steps_per_s": result.env_steps / wall,
           "updates": result.updates, "num_envs": num_envs, "segment_len": r.segment_len,
           "settings": settings, "budget_steps": steps, "cap_s": max_s,
           "gradient_steps": getattr(algo, "grad_steps", None), **extra}
    if c.virtual:
        out["virtual_s"] = result.wall_s
    return {"curve": curve, "out": out}


def _load_pushcube_demos(algo, spaces, seed: int, quick: bool) -> dict:
    """``PUSHCUBE_DEMOS`` episodes of the scripted expert into RLPD's demonstration buffer."""
    from ebrl.demos import DEMO_SEED, collect

    with tempfile.TemporaryDirectory(prefix="ebrl-sample-eff-") as tmp:
        t0 = time.perf_counter()
        summary = collect("maniskill/PushCube-v1", Path(tmp) / "demos", episodes=2 if quick else PUSHCUBE_DEMOS,
                          seed=DEMO_SEED + 1000 * seed)
        buf = algo.load_demos(Path(tmp) / "demos", spaces[0], spaces[1].shape, time_limit=50)
    return {"demo_episodes": summary["episodes"], "demo_success": summary["success_once"],
            "demo_transitions": len(buf), "demo_collect_s": time.perf_counter() - t0}


# ---- flow-dsrl: demonstrations, SFT, and the cost of a decision -------------------------------

def noisy_demos(episodes: int, seed: int):
    """``episodes`` of :func:`ring_reach`'s expert with Gaussian noise of std ``DEMO_NOISE`` on
    each action (clipped to the bounds), as :class:`~ebrl.demos.Demos`; and their success rate."""
    demos = ring_reach().expert_demos(episodes, seed, noise=DEMO_NOISE)
    return demos, float(np.mean([demos.frames["next.success"][end - 1] for _, end in demos.episodes]))


def success_rate(policy, episodes: int, seed: int) -> float:
    """Share of ``episodes`` of :func:`ring_reach` (chunked) that ``policy`` succeeds in, acting as
    it acts in training (sampled), all episodes side by side."""
    envs = [ring_env(i) for i in range(episodes)]
    obs = np.stack([env.reset(seed=seed + i)[0] for i, env in enumerate(envs)])
    done, success = np.zeros(episodes, bool), np.zeros(episodes, bool)
    while not done.all():
        actions = policy.act(obs).env_actions
        for i, env in enumerate(envs):
            if not done[i]:
                obs[i], _, terminated, truncated, info = env.step(actions[i])
                success[i] |= bool(info.get("success"))
                done[i] = terminated or truncated
    return float(success.mean())


def prepare_flow(seed: int, out_dir: str, quick: bool) -> dict:
    """SFT of the flow policy on noisy demonstrations for one seed (in a fresh process): its
    weights to ``out_dir``, its success as PPO's rollouts act (Flow-Noise) and as DSRL's base
    acts (the plain ODE from unit noise)."""
    import torch

    from ebrl.runtime.sim.stepping import single_spaces
    from ebrl.sft import SFTConfig, sft
    from ebrl.testing import torch_threads

    with torch_threads(1):
        probe = ring_env(0)
        spaces = single_spaces(probe)
        base_space = probe.env.action_space
        probe.close()
        demos, demo_success = noisy_demos(4 if quick else DEMOS, 7_000 + seed)
        policy = _flow_policy(spaces, seed, quick)
        t0 = time.perf_counter()
        history = sft(policy, demos, spaces[0], base_space, SFTConfig(seed=seed, epochs=2 if quick else None))
        sft_s = time.perf_counter() - t0
        path = Path(out_dir) / f"sft-{seed}.pt"
        torch.save(policy.state_dict(), path)
        episodes = 8 if quick else 200
        sampled = success_rate(policy, episodes, 30_000)
        policy.method = "ode"
        ode = success_rate(policy, episodes, 30_000)
    return {"sft_path": str(path), "sft_s": sft_s, "sft_frames": len(demos), "demo_success": demo_success,
            "sft_val_loss": history["val_loss"][-1], "sft_success_flow_noise": sampled, "sft_success_ode": ode}


def measure_cost(sft_path: str, quick: bool) -> dict:
    """Seconds per decision, one process, one torch thread, at each of ``COST_BATCHES``: DSRL's
    ``act`` (the frozen flow's forward and the steering actor's), PPO's ``act`` (Flow-Noise), and
    PPO's training per decision (``update_epochs`` passes of ``evaluate`` and ``backward`` of the
    clipped loss's inputs; minibatches as large as the batch)."""
    import torch

    from ebrl.algos import PPO
    from ebrl.policies.dsrl import DSRLPolicy
    from ebrl.runtime.sim.stepping import single_spaces
    from ebrl.testing import torch_threads

    with torch_threads(1):
        probe = ring_env(0)
        spaces = single_spaces(probe)
        probe.close()
        flow = _flow_policy(spaces, 0, quick)
        flow.load_state_dict(torch.load(sft_path, weights_only=True))
        dsrl = DSRLPolicy(_flow_policy(spaces, 0, quick), seed=0, **({"hidden": (32, 32)} if quick else {}))
        dsrl.base.load_state_dict(flow.state_dict())
        epochs = PPO().config.update_epochs
        rng = np.random.default_rng(0)
        out = [_cost_at(flow, dsrl, b, epochs, 3 if quick else 20, rng) for b in COST_BATCHES]
    return {"cost": out, "flow_params": sum(p.numel() for p in flow.parameters()),
            "steer_params": sum(p.numel() for p in dsrl.steer.parameters())}


def _cost_at(flow, dsrl, b: int, epochs: int, reps: int, rng: np.random.Generator) -> dict:
    import torch

    from ebrl.benchmark.suite import median_call_s

    obs = np.concatenate([rng.uniform(-0.3, 0.3, (b, 2)), ring_reach().targets[rng.integers(6, size=b)]],
                         1).astype(np.float32)
    chains = torch.as_tensor(flow.act(obs).actions)
    obs_t = torch.as_tensor(obs)

    def train_pass():
        logp, entropy, value = flow.evaluate(obs_t, chains)
        flow.zero_grad(set_to_none=True)
        (logp.mean() + entropy.mean() + value.square().mean()).backward()

    cpu = torch.device("cpu")
    dsrl_act = median_call_s(lambda: dsrl.act(obs), cpu, reps)
    ppo_act = median_call_s(lambda: flow.act(obs), cpu, reps)
    ppo_pass = median_call_s(train_pass, cpu, reps)
    one = {"batch": b, "dsrl_act_us": 1e6 * dsrl_act / b, "ppo_act_us": 1e6 * ppo_act / b,
           "ppo_train_us": 1e6 * epochs * ppo_pass / b, "ppo_update_epochs": epochs,
           "ppo_total_us": 1e6 * (ppo_act + epochs * ppo_pass) / b}
    one["ppo_over_dsrl"] = one["ppo_total_us"] / one["dsrl_act_us"]
    return one


# ---- the suite --------------------------------------------------------------------------------

def _counts(row: dict) -> bool:
    """Whether a curve row is at the threshold: its score over a full window of episodes."""
    s = row["score"]
    return s is not None and not math.isnan(s) and s >= THRESHOLD and row.get("episodes", 0) >= WINDOW


def _reached(curve: list[dict]) -> dict | None:
    return next((row for row in curve if _counts(row)), None)


def _final(curve: list[dict]) -> float:
    scores = [r["score"] for r in curve if r["score"] is not None and not math.isnan(r["score"])]
    return scores[-1] if scores else math.nan


def _ratio(rows: list[dict], case: str, other: str) -> dict:
    """PPO's env steps to the threshold over ``other``'s, per seed where ``other`` reached it; where
    PPO did not, its whole run (a lower bound, counted in ``lower_bounds``)."""
    values, bounds, missing = [], 0, 0
    for seed in sorted({r["round"] for r in rows if r["case"] == case}):
        by = {r["runner"]: r for r in rows if r["case"] == case and r["round"] == seed}
        p, o = by.get("ppo"), by.get(other)
        if p is None or o is None:
            continue
        if o["steps_to_threshold"] is None:
            missing += 1
            continue
        ppo_steps = p["steps_to_threshold"]
        if ppo_steps is None:
            ppo_steps, bounds = p["env_steps"], bounds + 1
        values.append(ppo_steps / o["steps_to_threshold"])
    return {**spread(values), "lower_bounds": bounds, "not_reached": missing}


def fmt_ratio(s: dict) -> str:
    from ebrl.benchmark.report import fmt_ratio as fmt

    return fmt(s)


def _fmt(s: dict, unit: str = "") -> str:
    from ebrl.benchmark.report import fmt_spread

    return fmt_spread(s, unit)


def run(quick: bool, in_process: bool = False) -> dict:
    """Every run in a fresh process (as a user's script), unless ``in_process``."""
    import os

    from ebrl.benchmark.fresh import call_fresh

    def call(fn: str, args: dict) -> dict:
        return globals()[fn](**args) if in_process else call_fresh(f"suite:sample-efficiency:{fn}", args)

    names = tuple(os.environ.get("EBRL_SAMPLE_EFFICIENCY", ",".join(CASES)).split(","))
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise ValueError(f"unknown sample-efficiency case(s) {unknown}; known: {list(CASES)}")
    seeds = SEEDS[:1] if quick else SEEDS
    rows, preps, costs = [], [], []
    with tempfile.TemporaryDirectory(prefix="ebrl-sample-eff-") as tmp:
        for case in names:
            c = CASES[case]
            for seed in seeds:
                prep = {}
                if case == "flow-dsrl":
                    prep = call("prepare_flow", {"seed": seed, "out_dir": tmp, "quick": quick})
                    preps.append({"round": seed, **prep})
                    print(f"  {case} seed {seed}: SFT on {prep['sft_frames']} frames (demos succeed "
                          f"{prep['demo_success']:.2f}): success {prep['sft_success_flow_noise']:.2f} (Flow-Noise), "
                          f"{prep['sft_success_ode']:.2f} (ODE)", flush=True)
                for runner in c.runners:
                    t0 = time.perf_counter()
                    args = {"case": case, "runner": runner, "seed": seed, "quick": quick,
                            "sft_path": prep.get("sft_path")}
                    one = call("measure_run", args)
                    curve, out = one["curve"], one["out"]
                    hit = _reached(curve)
                    rows.append({"case": case, "round": seed, "runner": runner, **out,
                                 "time_to_threshold_s": None if hit is None else hit["time"],
                                 "steps_to_threshold": None if hit is None else hit["env_steps"],
                                 "final_success": _final(curve), "threshold": THRESHOLD,
                                 "elapsed_s": time.perf_counter() - t0, "curve": curve})
                    print(f"  {case} seed {seed} {runner}: {out['env_steps']:,} steps in {out['wall_s']:.0f} s, "
                          f"final success {rows[-1]['final_success']:.2f}, 0.8 "
                          + (f"at {hit['env_steps']:,} steps, {hit['time']:.0f} s" if hit else "not reached"),
                          flush=True)
            if case == "flow-dsrl" and preps:
                costs.append(call("measure_cost", {"sft_path": preps[0]["sft_path"], "quick": quick}))
    return _report(rows, preps, costs, names, seeds, quick, in_process)


def _report(rows, preps, costs, names, seeds, quick, in_process) -> dict:
    ratios, figures, notes = {}, {}, []
    for case in names:
        for runner in CASES[case].runners:
            mine = [r for r in rows if r["case"] == case and r["runner"] == runner]
            reached = [r for r in mine if r["steps_to_threshold"] is not None]
            steps = figures[f"{case}: {runner} steps to threshold"] = spread(r["steps_to_threshold"] for r in reached)
            secs = figures[f"{case}: {runner} seconds to threshold"] = spread(r["time_to_threshold_s"] for r in reached)
            final = figures[f"{case}: {runner} final success"] = spread(r["final_success"] for r in mine)
            if not mine:
                continue
            ran = figures[f"{case}: {runner} env steps run"] = spread(r["env_steps"] for r in mine)
            grads = spread(r["gradient_steps"] for r in mine if r.get("gradient_steps") is not None)
            notes.append(f"{case} {runner}: success 0.8 reached in {len(reached)} of {len(mine)} runs; env steps to it "
                         f"{_fmt(steps)}, seconds {_fmt(secs)}; final success {_fmt(final)}; env steps run {_fmt(ran)} "
                         f"of a budget of {mine[0]['budget_steps']:,} or {mine[0]['cap_s']:.0f} s"
                         + (f"; gradient steps {_fmt(grads)}" if grads["n"] else ""))
        for runner in list(CASES[case].runners)[1:]:
            ratios[f"{case}: ppo/{runner}"] = _ratio(rows, case, runner)
    for p in preps:
        figures.setdefault("flow-dsrl: SFT success (Flow-Noise)", []).append(p["sft_success_flow_noise"])
        figures.setdefault("flow-dsrl: SFT success (ODE)", []).append(p["sft_success_ode"])
    for key in ("flow-dsrl: SFT success (Flow-Noise)", "flow-dsrl: SFT success (ODE)"):
        if key in figures:
            figures[key] = spread(figures[key])
            notes.append(f"{key} before RL: {_fmt(figures[key])}")
    for c in costs:
        for one in c["cost"]:
            notes.append(f"flow-dsrl cost per decision at batch {one['batch']}: DSRL act {one['dsrl_act_us']:.0f} µs; "
                         f"PPO act {one['ppo_act_us']:.0f} µs + {one['ppo_update_epochs']} x forward-backward "
                         f"{one['ppo_train_us']:.0f} µs = {one['ppo_total_us']:.0f} µs "
                         f"({one['ppo_over_dsrl']:.1f}x DSRL's)")
    wanted = {name: Target(TARGET) for name in ratios}
    targets = check_targets(ratios, wanted)
    for t in targets:  # a ratio counts only where the off-policy runner reached the threshold in every seed
        r = ratios.get(t["figure"])
        if r is not None and r["n"] < len(seeds):
            t["met"] = False
            t["note"] = (f"{r['median']:.2f}x over {r['n']} of {len(seeds)} seeds" if r["n"] else "not measured") + \
                f": {t['figure'].split('/')[-1]} did not reach {THRESHOLD:g} in {r['not_reached']}"
        if r is not None and r["lower_bounds"]:
            bound = f"{r['lower_bounds']} of {r['n']} a lower bound (PPO did not reach {THRESHOLD:g})"
            t["note"] = f"{t['note']}; {bound}" if t.get("note") else f"{fmt_ratio(r)}, {bound}"
    cases_met = sorted({t["figure"].split(":")[0] for t in targets if t["met"]})
    targets.append({"figure": f"cases where off-policy reaches {THRESHOLD:g} in <= 1/{TARGET:g} of PPO's env steps",
                    "target": f">= {CASES_NEEDED} of {len(names)}", "median": float(len(cases_met)),
                    "min": float(len(cases_met)), "max": float(len(cases_met)), "n": 1, "unit": "",
                    "met": len(cases_met) >= CASES_NEEDED,
                    "note": f"{len(cases_met)} of {len(names)}" + (f" ({', '.join(cases_met)})" if cases_met else "")})
    ratios = {k: v for k, v in ratios.items() if v["n"]}
    return {"rows": rows, "ratios": ratios, "figures": figures, "targets": targets, "notes": notes,
            "meta": {"description": DESCRIPTION, "quick": quick, "seeds": list(seeds), "rounds": len(seeds),
                     "fresh_processes": not in_process, "threshold": THRESHOLD, "score": "success_once",
                     "target": TARGET, "sft": preps, "cost": costs, "fetch_reward": FETCH_REWARD,
                     "scale": 1.0 if quick else scale(),
                     "cases": {n: {"num_envs": CASES[n].num_envs, "virtual": CASES[n].virtual,
                                   "runners": {k: {"steps": int(r.steps * (1.0 if quick else scale())),
                                                   "max_s": r.max_s * (1.0 if quick else scale()),
                                                   "segment_len": r.segment_len,
                                                   "settings": dict(r.settings)}
                                               for k, r in CASES[n].runners.items()}} for n in names}}}
