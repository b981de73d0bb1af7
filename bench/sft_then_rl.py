"""SFT then RL on a tiny random π0, as docs/policies.md's recipe runs on a CPU: does RL from the
SFT policy keep what SFT taught, at ``ebrl train``'s defaults?

    python bench/sft_then_rl.py OUT [--layout transformers|lerobot] [--updates 3 40] [--generic]

Writes a random π0 (``save_random_pi0``, in transformers' or LeRobot's layout), 10 scripted
``mock/reach`` demonstrations, ``ebrl sft`` with LoRA 4 and ``execute=2``, then for each count in
``--updates`` an ``ebrl train --set policy.init=SFT`` run of that many updates (8 envs x 16
decisions each, in virtual time, one torch thread: repeatable) and the deterministic success of
each policy over 40 episodes with its 95% interval. ``--generic`` runs PPO's generic defaults
instead of the policy's ``RL_DEFAULTS``; ``--value-pass`` fits the critic in SFT too. Prints one JSON
line per policy; OUT keeps the SFT output,
so a second call reuses it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--layout", choices=("transformers", "lerobot"), default="transformers")
    p.add_argument("--updates", type=int, nargs="+", default=[3, 40])
    p.add_argument("--generic", action="store_true", help="PPO's generic defaults, not the policy's RL_DEFAULTS")
    p.add_argument("--episodes", type=int, default=40)
    p.add_argument("--seed", type=int, default=0, help="the RL runs' run.seed")
    p.add_argument("--value-pass", action="store_true", help="SFT fits the critic too (sft.value_pass=true)")
    args = p.parse_args(argv)

    from ebrl.cli import main as ebrl
    from ebrl.evaluation import EVAL_SEED, evaluate
    from ebrl.runs import build_spec, build_trainer, load_run
    from ebrl.testing import InstructedReach, run_virtual, save_random_pi0, torch_threads

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if not (out / "sft").exists():
        lerobot = dict(layout="lerobot", tokenizer_dir=out / "tokenizer", camera_names=[]) if args.layout == "lerobot" \
            else {}
        save_random_pi0(out / "pi0", kind="pi0", state_dim=4, action_dim=2, chunk_size=4,
                        sentences=tuple(InstructedReach().instructions()), **lerobot)
        assert ebrl(["demos", "collect", "mock/reach", "--policy", "scripted", "--episodes", "10",
                     "--out", str(out / "demos")]) == 0
        tokenizer = ["--set", f"policy.tokenizer={out / 'tokenizer'}"] if args.layout == "lerobot" else []
        assert ebrl(["sft", str(out / "demos"), "--set", "policy.kind=hf", "--set", f"policy.path={out / 'pi0'}",
                     *tokenizer, *(["--set", "sft.value_pass=true"] if args.value_pass else []),
                     "--set", "policy.execute=2", "--set", "policy.lora_rank=4", "--out", str(out / "sft"),
                     "--quiet"]) == 0

    def success(policy) -> dict:
        env = InstructedReach()
        try:
            with torch_threads(1):
                r = evaluate(policy, env, episodes=args.episodes, seed=EVAL_SEED, deterministic=True)
        finally:
            env.close()
        return {"success": r.success_once, "ci95": list(r.success_once_ci), "return": r.mean_return}

    _, trainer = load_run(out / "sft")
    print(json.dumps({"policy": "sft", **success(trainer.policy), "wall_s": round(time.perf_counter() - start)}),
          flush=True)
    for updates in args.updates:
        settings = ["env=mock/reach", f"policy.init={out / 'sft'}", "run.num_envs=8", "run.segment_len=16",
                    f"run.total_env_steps={8 * 16 * updates}", f"run.seed={args.seed}"]
        spec = build_spec(None, settings)
        if args.generic:  # PPOConfig's own defaults, over the policy's (TOML has no null: set here)
            spec["ppo"].update(lr=3e-4, critic_warmup_updates=0, max_kl=0.0, critic_lr=None)
        trainer = build_trainer(spec)
        with torch_threads(1):
            result = run_virtual(trainer)
        lrs = [round(float(h["lr"]), 7) for h in result.history if "lr" in h]
        print(json.dumps({"policy": f"{updates} updates", "ppo": spec["ppo"], **success(trainer.policy),
                          "lr_last": lrs[-1] if lrs else None,
                          "kl_stopped": sum(float(h.get("kl_stopped", 0)) for h in result.history),
                          "first_value_loss": next((round(float(h["value_loss"]), 4) for h in result.history
                                                   if "value_loss" in h), None),
                          "wall_s": round(time.perf_counter() - start)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
