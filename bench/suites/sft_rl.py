"""SFT, then RL: what RL adds to a policy cloned from too few demonstrations.

On ManiSkill3 ``PickCube-v1`` from state (SAPIEN's CPU backend, end-effector control
``pd_ee_delta_pos``, the scripted expert's), per seed:

1. ``DEMOS`` episodes of the scripted expert (``ebrl demos collect``; it succeeds in each);
2. SFT of an MLP policy on them (``ebrl sft``'s defaults, 200 epochs, and a value pass so that
   PPO's critic does not start from nothing; ``log_std`` is SFT's fit to the held-out error,
   ``SFTConfig.fit_std``); success measured by
   :func:`ebrl.evaluation.evaluate` (``EVAL_EPISODES`` episodes on the evaluation seeds, the
   policy's mode; ``sft_sampled_success`` is the same with sampled actions, as RL's rollouts act:
   GRPO learns only from reset groups holding both a success and a failure). In exploratory
   runs 10 demonstrations cloned to success 0.0 and 100 to 0.33: too few to solve the task,
   enough to start from;
3. RL from the SFT weights for ``MAX_S`` seconds, each run a fresh process: PPO on ManiSkill's
   dense reward under ``async`` and ``sync``, and GRPO on the sparse success under ``sync`` (its
   preferred schedule), 16 envs, every knob at its default but two that follow ManiSkill's PPO
   baseline for PPO: its discount (``gamma=0.8``, as in ``embodied-learning``) and no episode end at
   success (``ignore_terminations=True``; the baseline bootstraps at every episode end instead):
   ended there, an episode forfeits the dense reward that hovering near the goal keeps paying, and
   PPO learns to avoid success (see :mod:`ebrl.envs.maniskill`); evaluated every
   ``EVAL_EVERY_S`` during the run (``run.eval_every_s``, ``EVAL_DURING`` episodes) and as SFT
   was at the end.

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

DESCRIPTION = ("SFT on 100 scripted demos, then RL (PPO dense async/sync, GRPO sparse) on real ManiSkill PickCube-v1 "
               "(CPU): success after SFT and after RL, time to +0.3, 3 seeds")
ENV = "maniskill/PickCube-v1"
CONTROL = {"control_mode": "pd_ee_delta_pos"}
SEEDS = (0, 1, 2)
DEMOS = 100  # the expert's episodes: SFT on them reaches about a third of its success (10 reached none)
EVAL_EPISODES = 50
NUM_ENVS = 16
MAX_S = 600.0  # seconds of RL per run
EVAL_EVERY_S, EVAL_DURING = 60.0, 10  # evaluation during RL: every minute, 10 episodes
GAIN = 0.3
RUNS = (("ppo", "async"), ("ppo", "sync"), ("grpo", "sync"))
SFT_EPOCHS = 200  # SFTConfig's 30 epochs are 210 gradient steps on 100 demonstrations' 1,800 frames


def env_fn(reward_mode: str, ignore_terminations: bool = False):
    def make(i: int):
        from ebrl.envs import make as make_env

        return make_env(ENV, reward_mode=reward_mode, ignore_terminations=ignore_terminations, **CONTROL)

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
    collected = collect(ENV, demos_dir, episodes=2 if quick else DEMOS, seed=DEMO_SEED + 1000 * seed,
                        env_kwargs=CONTROL)
    env = make(ENV, **CONTROL)
    try:
        policy = MLPPolicy.from_spaces(env.observation_space, env.action_space, seed=seed)
        t0 = time.perf_counter()
        history = sft(policy, read_lerobot(demos_dir), env.observation_space, env.action_space,
                      SFTConfig(seed=seed, value_pass=True, gamma=0.8, epochs=2 if quick else SFT_EPOCHS))
        sft_s = time.perf_counter() - t0
        result, sampled = score(policy, env, quick)
    finally:
        env.close()
    spec = {"env": ENV, "env_kwargs": dict(CONTROL), "policy": {"kind": "mlp"}}
    save_sft(policy_dir, policy, spec, history)
    return {"demo_success": collected["success_once"], "demo_frames": collected["frames"], "sft_s": sft_s,
            "sft_success": result.success_once, "sft_sampled_success": sampled.success_once,
            "sft_val_loss": history["val_loss"][-1], "sft_log_std": history.get("log_std"),
            "policy_dir": str(policy_dir)}


def measure_run(algo: str, schedule: str, seed: int, policy_dir: str, sft_success: float, quick: bool) -> dict:
    """One RL run from the SFT weights (in a fresh process) for ``MAX_S`` seconds, evaluated every
    ``EVAL_EVERY_S`` during it (``run.eval_every_s``: the policy's mode, ``EVAL_DURING`` episodes, in
    a thread beside rollout), then evaluated as SFT was."""
    import ebrl
    from ebrl.algos import GRPO, PPO
    from ebrl.benchmark.suite import run_capped
    from ebrl.envs import make
    from ebrl.policies import MLPPolicy
    from ebrl.runs import load_policy_weights

    fn = env_fn("normalized_dense", ignore_terminations=True) if algo == "ppo" else env_fn("sparse")
    probe = fn(0)
    policy = MLPPolicy.from_spaces(probe.observation_space, probe.action_space, seed=seed)
    probe.close()
    load_policy_weights(policy_dir, policy)  # log_std included: SFT's fit
    policy.freeze_obs_stats()  # as ebrl train with policy.init: the statistics SFT's weights were fitted to
    algorithm = PPO(seed=seed, gamma=0.8) if algo == "ppo" else GRPO(seed=seed)
    # quick: one segment of 4 envs (a count, not seconds: a loaded machine may spend seconds building envs)
    envs = 4 if quick else NUM_ENVS
    cfg = ebrl.RunConfig(num_envs=envs, segment_len=50, total_env_steps=envs * 50 if quick else 10_000_000,
                         schedule=schedule, seed=seed, eval_every_s=3.0 if quick else EVAL_EVERY_S,
                         eval_episodes=EVAL_DURING)
    result = run_capped(ebrl.Trainer(fn, policy, algorithm, cfg), 300.0 if quick else MAX_S)
    goal = min(1.0, sft_success + GAIN)
    hit = next((e for e in result.evaluations if e["success_once"] >= goal), None)
    env = make(ENV, **CONTROL)
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
                        "sft_success": prep["sft_success"], "quick": quick}
                out = measure_run(**args) if in_process else call_fresh("suite:sft-rl:measure_run", args)
                row = {"case": f"{algo}-{schedule}", "runner": f"{algo}-{schedule}", "round": seed,
                       **{k: v for k, v in prep.items() if k != "policy_dir"}, **out,
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
                     "fresh_processes": not in_process, "env": ENV, "demos": DEMOS, "eval_episodes": EVAL_EPISODES,
                     "num_envs": NUM_ENVS, "max_s": MAX_S, "runs": [list(r) for r in RUNS]}}
