"""SFT, then RL: what RL adds to a policy cloned from too few demonstrations.

On gymnasium-robotics ``FetchPickAndPlace-v4`` from state (MuJoCo), per seed:

1. ``DEMOS`` episodes of the scripted expert (``ebrl demos collect``);
2. SFT of an MLP policy on them (``ebrl sft``'s defaults: 250 passes here, enough for ``min_steps``; a value pass
   so that PPO's critic does not start from nothing; ``log_std`` is SFT's fit to the held-out error,
   ``SFTConfig.fit_std``); success measured by :func:`ebrl.evaluation.evaluate` (``EVAL_EPISODES``
   episodes on the evaluation seeds, the policy's mode; ``sft_sampled_success`` is the same with
   sampled actions, as RL's rollouts act). In exploratory runs 20 demonstrations cloned to
   success 0.10-0.30 over three seeds and 100 to 0.28: more demonstrations do not solve the task,
   so 20 are "too few" and enough to start from;
3. RL from the SFT weights for ``MAX_S`` seconds, each run a fresh process: PPO on the dense reward
   (``FetchPickAndPlaceDense-v4``) under ``async`` and ``sync``, and GRPO on the sparse success
   under ``sync`` (its preferred schedule), 16 envs, every knob at its default. RL keeps the
   demonstrations in its loss (``demos=DemoLoss(...)`` at its default weights, DAPG's decaying
   behaviour-cloning term; ``ppo.demos`` on the command line): without it, PPO and GRPO walked
   off the clone in every exploratory run (docs/demos.md). Evaluated every ``EVAL_EVERY_S``
   during the run (``run.eval_every_s``, ``EVAL_DURING`` episodes) and as SFT was at the end.

Reported per seed and run: success after SFT and after RL (the mode), the gain, the same two
with sampled actions (``sft_sampled_success``, ``rl_sampled_success``: what RL's rollouts do), the
seconds from the RL start to the first evaluation at SFT + 0.3 (or not reached), and PPO's
sync/async ratio of that time. Target: RL adds at least 0.3 success (the mode's) over SFT alone
in every seed and run. A full run takes about 100 minutes (3 seeds x 3 runs x 10 minutes, plus
demonstrations, SFT and evaluations).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from ebrl.benchmark.figures import spread

DESCRIPTION = ("SFT on 20 scripted demos, then RL with the demos in its loss (PPO dense async/sync, GRPO sparse) on "
               "FetchPickAndPlace-v4 (MuJoCo): success after SFT and after RL, time to +0.3, 3 seeds")
ENV = "robotics/FetchPickAndPlace-v4"  # sparse success: the demonstrations, GRPO and every evaluation
DENSE_ENV = "robotics/FetchPickAndPlaceDense-v4"  # the same task and observations, reward -distance: PPO's
SEEDS = (0, 1, 2)
DEMOS = 20  # the expert's episodes: the clone reaches 0.1-0.3 success (100 episodes reached no more)
EVAL_EPISODES = 50
NUM_ENVS = 16
MAX_S = 600.0  # seconds of RL per run
EVAL_EVERY_S, EVAL_DURING = 60.0, 10  # evaluation during RL: every minute, 10 episodes
GAIN = 0.3
RUNS = (("ppo", "async"), ("ppo", "sync"), ("grpo", "sync"))


def env_fn(name: str):
    def make(i: int):
        from ebrl.envs import make as make_env

        return make_env(name)

    return make


def score(policy, env, quick: bool):
    """The policy's mode and its sampled actions (as RL's rollouts act), on the same evaluation
    episodes: one protocol for the clone and for every RL run."""
    from ebrl.evaluation import evaluate

    episodes = 2 if quick else EVAL_EPISODES
    return evaluate(policy, env, episodes=episodes, deterministic=True), evaluate(policy, env, episodes=episodes)


def prepare(seed: int, root: Path, quick: bool) -> dict:
    """Demonstrations, SFT and its evaluation for one seed; the SFT policy saved under ``root``."""
    from ebrl.demos import DEMO_SEED, collect, read_lerobot
    from ebrl.envs import make
    from ebrl.policies import MLPPolicy
    from ebrl.sft import SFTConfig, save_sft, sft

    demos_dir, policy_dir = root / f"demos-{seed}", root / f"sft-{seed}"
    collected = collect(ENV, demos_dir, episodes=2 if quick else DEMOS, seed=DEMO_SEED + 1000 * seed)
    env = make(ENV)
    try:
        policy = MLPPolicy.from_spaces(env.observation_space, env.action_space, seed=seed)
        t0 = time.perf_counter()
        history = sft(policy, read_lerobot(demos_dir), env.observation_space, env.action_space,
                      SFTConfig(seed=seed, value_pass=True, epochs=2 if quick else None))
        sft_s = time.perf_counter() - t0
        result, sampled = score(policy, env, quick)
    finally:
        env.close()
    spec = {"env": ENV, "policy": {"kind": "mlp"}}
    save_sft(policy_dir, policy, spec, history)
    return {"demo_success": collected["success_once"], "demo_frames": collected["frames"], "sft_s": sft_s,
            "sft_success": result.success_once, "sft_sampled_success": sampled.success_once,
            "sft_val_loss": history["val_loss"][-1], "sft_log_std": history.get("log_std"),
            "policy_dir": str(policy_dir), "demos_dir": str(demos_dir)}


def measure_run(algo: str, schedule: str, seed: int, policy_dir: str, demos_dir: str, sft_success: float,
                quick: bool) -> dict:
    """One RL run from the SFT weights (in a fresh process) for ``MAX_S`` seconds, the demonstrations
    in its loss, evaluated every ``EVAL_EVERY_S`` during it (``run.eval_every_s``: the policy's mode,
    ``EVAL_DURING`` episodes, in a thread beside rollout), then evaluated as SFT was."""
    import ebrl
    from ebrl.algos import GRPO, PPO
    from ebrl.algos.demo_loss import DemoLoss
    from ebrl.benchmark.suite import run_capped
    from ebrl.envs import make
    from ebrl.policies import MLPPolicy
    from ebrl.runs import load_policy_weights

    fn = env_fn(DENSE_ENV if algo == "ppo" else ENV)
    probe = fn(0)
    policy = MLPPolicy.from_spaces(probe.observation_space, probe.action_space, seed=seed)
    demos = DemoLoss(demos_dir, probe.observation_space, probe.action_space, seed=seed)
    probe.close()
    load_policy_weights(policy_dir, policy)  # log_std included: SFT's fit
    policy.freeze_obs_stats()  # as ebrl train with policy.init: the statistics SFT's weights were fitted to
    algorithm = PPO(seed=seed, demos=demos) if algo == "ppo" else GRPO(seed=seed, demos=demos)
    # quick: one segment of 4 envs (a count, not seconds: a loaded machine may spend seconds building envs)
    envs = 4 if quick else NUM_ENVS
    cfg = ebrl.RunConfig(num_envs=envs, segment_len=50, total_env_steps=envs * 50 if quick else 10_000_000,
                         schedule=schedule, seed=seed, eval_every_s=3.0 if quick else EVAL_EVERY_S,
                         eval_episodes=EVAL_DURING)
    result = run_capped(ebrl.Trainer(fn, policy, algorithm, cfg), 300.0 if quick else MAX_S)
    goal = min(1.0, sft_success + GAIN)
    hit = next((e for e in result.evaluations if e["success_once"] >= goal), None)
    env = make(ENV)
    try:
        after, sampled = score(policy, env, quick)
    finally:
        env.close()
    return {"rl_success": after.success_once, "rl_success_ci": list(after.success_once_ci),
            "rl_sampled_success": sampled.success_once, "rl_s": result.wall_s,
            "env_steps": result.env_steps, "steps_per_s": result.env_steps_per_s,
            "time_to_gain_s": None if hit is None else hit["time"],
            "steps_to_gain": None if hit is None else hit["env_steps"],
            "evaluations": [{k: e[k] for k in ("time", "env_steps", "success_once")} for e in result.evaluations],
            "train_success": [{"time": h["time"], "success_once": h.get("success_once")} for h in result.history]}


def run(quick: bool, in_process: bool = False) -> dict:
    from ebrl.benchmark.fresh import call_fresh

    import os

    chosen = os.environ.get("EBRL_SFT_RL_SEEDS")  # e.g. "0": fewer seeds, for an exploratory run
    seeds = SEEDS[:1] if quick else tuple(int(x) for x in chosen.split(",")) if chosen else SEEDS
    rows = []
    with tempfile.TemporaryDirectory(prefix="ebrl-sft-rl-") as tmp:
        for seed in seeds:
            prep = prepare(seed, Path(tmp), quick)
            print(f"  seed {seed}: demos {prep['demo_frames']} frames, SFT success {prep['sft_success']:.2f}",
                  flush=True)
            for algo, schedule in RUNS:
                args = {"algo": algo, "schedule": schedule, "seed": seed, "policy_dir": prep["policy_dir"],
                        "demos_dir": prep["demos_dir"],
                        "sft_success": prep["sft_success"], "quick": quick}
                out = measure_run(**args) if in_process else call_fresh("suite:sft-rl:measure_run", args)
                row = {"case": f"{algo}-{schedule}", "runner": f"{algo}-{schedule}", "round": seed,
                       **{k: v for k, v in prep.items() if not k.endswith("_dir")}, **out,
                       "gain": out["rl_success"] - prep["sft_success"]}
                rows.append(row)
                reached = row["time_to_gain_s"]
                print(f"  seed {seed} {algo} {schedule}: success {prep['sft_success']:.2f} -> {out['rl_success']:.2f}"
                      f", +{GAIN} {'at %.0f s' % reached if reached is not None else 'not reached'}", flush=True)
    figures, ratios = {}, {}
    for algo, schedule in RUNS:
        mine = [r for r in rows if r["case"] == f"{algo}-{schedule}"]
        figures[f"{algo}-{schedule}: success after SFT"] = spread(r["sft_success"] for r in mine)
        figures[f"{algo}-{schedule}: success after RL"] = spread(r["rl_success"] for r in mine)
        figures[f"{algo}-{schedule}: gain"] = spread(r["gain"] for r in mine)
        figures[f"{algo}-{schedule}: sampled success after SFT"] = spread(r["sft_sampled_success"] for r in mine)
        figures[f"{algo}-{schedule}: sampled success after RL"] = spread(r["rl_sampled_success"] for r in mine)
        figures[f"{algo}-{schedule}: seconds to +{GAIN}"] = spread(
            r["time_to_gain_s"] for r in mine if r["time_to_gain_s"] is not None)
    pairs = []
    for seed in seeds:
        by = {r["case"]: r for r in rows if r["round"] == seed}
        a, s = by.get("ppo-async"), by.get("ppo-sync")
        if a and s and a["time_to_gain_s"] is not None and s["time_to_gain_s"] is not None:
            pairs.append(s["time_to_gain_s"] / a["time_to_gain_s"])
    if pairs:
        ratios["ppo: time to +0.3, sync/async"] = spread(pairs)
    gains = spread(r["gain"] for r in rows)  # the target holds for every seed and run: judged on the min
    targets = [{"figure": "success gained by RL over SFT (each seed and run)", "target": f">= {GAIN} in each",
                "median": gains["median"], "min": gains["min"], "max": gains["max"], "n": gains["n"], "unit": "",
                "met": bool(gains["n"]) and gains["min"] >= GAIN}]
    return {"rows": rows, "summary": {}, "ratios": ratios, "figures": figures, "targets": targets,
            "meta": {"description": DESCRIPTION, "quick": quick, "seeds": list(seeds), "rounds": len(seeds),
                     "fresh_processes": not in_process, "env": ENV, "dense_env": DENSE_ENV, "demos": DEMOS,
                     "demo_loss": "DemoLoss defaults", "eval_episodes": EVAL_EPISODES,
                     "num_envs": NUM_ENVS, "max_s": MAX_S, "runs": [list(r) for r in RUNS]}}
