"""``ebrl demos collect``, ``ebrl sft`` and ``ebrl eval``: from demonstrations to RL, and the result.

    ebrl demos collect robotics/FetchPush-v4 --episodes 20 --out demos/push
    ebrl sft demos/push --out runs/push-sft
    ebrl train --set env=robotics/FetchPush-v4 --set policy.init=runs/push-sft
    ebrl eval runs/<run> --episodes 50 --video push.mp4
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from ebrl.config import ConfigError, parse_setting


def _env_kwargs(items: list[str] | None) -> dict[str, Any]:
    return dict(parse_setting(item, "--env-kwarg", "pixels=64") for item in items or [])


def cmd_collect(args: argparse.Namespace) -> int:
    from ebrl.demos import collect

    if args.episodes < 1:
        raise ConfigError("--episodes", args.episodes, "must be at least 1")
    if Path(args.out).exists() and any(Path(args.out).iterdir()):
        raise ConfigError("--out", args.out, "is not empty: a dataset is written into a new directory")
    try:
        summary = collect(args.env, args.out, episodes=args.episodes, policy=args.policy,
                          env_kwargs=_env_kwargs(args.env_kwarg), seed=args.seed, only_success=args.only_success,
                          image_format="image" if args.images == "png" else "video")
    except (ValueError, FileNotFoundError) as exc:  # no expert for the env, an unknown env, not a run directory
        raise ConfigError("demos collect", args.env, str(exc)) from None
    print(f"wrote {summary['episodes']} episodes ({summary['frames']:,} frames) of {args.env} to {args.out}; "
          f"{summary['tried']} tried, success {summary['success_once']:.2f}")
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    from ebrl.demos import read_lerobot
    from ebrl.runs import build_spec, build_trainer
    from ebrl.runtime.env_facts import EnvFacts
    from ebrl.sft import SFTConfig, save_sft, sft
    from ebrl.telemetry.metrics import MetricsLog

    try:
        demos = read_lerobot(args.dataset)
    except FileNotFoundError as exc:
        raise ConfigError("dataset", args.dataset, str(exc)) from None
    made_by = demos.info.get("ebrl", {})
    spec = build_spec(args.config, [])
    if args.env or made_by.get("env"):
        spec["env"] = args.env or made_by["env"]
        spec["env_kwargs"] = dict(made_by.get("env_kwargs", {})) if not args.env else {}
    else:
        raise ConfigError("--env", None, f"{args.dataset} does not say which env it is from: name it with --env")
    for item in args.set or []:  # --set after the dataset's env, so it wins
        spec = _override(spec, item)
    options = dict(spec.get("sft", {}))
    try:
        config = SFTConfig(**options)
    except (TypeError, ValueError) as exc:
        raise ConfigError("sft", options, str(exc)) from None
    trainer = build_trainer(spec)
    probe = trainer.env_fn(0)
    try:
        facts = EnvFacts.of(probe)
    finally:
        probe.close()
    out = Path(args.out)
    metrics = MetricsLog(out)
    metrics.open()
    try:
        history = sft(trainer.policy, demos, facts.observation_space, facts.action_space, config, metrics=metrics,
                      progress=None if args.quiet else _print_epoch)
    except (ValueError, KeyError) as exc:  # the dataset does not fit the env or the policy
        raise ConfigError("dataset", args.dataset, str(exc)) from None
    finally:
        metrics.close()
    save_sft(out, trainer.policy, spec, history)
    val = history["val_loss"][-1]
    print(f"sft: {history['frames']:,} frames, {history['train_episodes']} episodes to train on and "
          f"{history['val_episodes']} held out, {history['epochs']} passes; "
          f"loss {history['train_loss'][0]:.4f} -> {history['train_loss'][-1]:.4f}"
          + ("" if math.isnan(val) else f", held out {history['val_loss'][0]:.4f} -> {val:.4f}"))
    print(f"policy: {out}/  (ebrl train --set policy.init={out}; ebrl eval {out})")
    return 0


def _override(spec: dict[str, Any], item: str) -> dict[str, Any]:
    from ebrl.runs import build_spec

    merged = build_spec(None, [item])  # validates the key
    head = item.partition("=")[0].strip().partition(".")[0]
    spec = dict(spec)
    spec[head] = {**spec.get(head, {}), **merged[head]} if isinstance(merged[head], dict) else merged[head]
    return spec


def _print_epoch(epoch: int, train: float, val: float) -> None:
    print(f"epoch {epoch}: loss {train:.4f}" + ("" if math.isnan(val) else f", held out {val:.4f}"), flush=True)


def cmd_export(args: argparse.Namespace) -> int:
    """``ebrl export RUN --format lerobot|transformers --out DIR``: the run's policy, trained
    weights merged, in a layout other tools load (:mod:`ebrl.policies.pi0.lerobot`; a SmolVLA:
    LeRobot's only, :func:`~ebrl.policies.smolvla.lerobot.save_smolvla_lerobot`)."""
    from ebrl.policies.pi0.lerobot import save_lerobot, save_transformers
    from ebrl.policies.pi0.policy import PI0Policy
    from ebrl.policies.smolvla.lerobot import save_smolvla_lerobot
    from ebrl.policies.smolvla.policy import SmolVLAPolicy
    from ebrl.runs import load_run, read_spec

    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError("--out", args.out, "exists and is not empty: export writes a new directory")
    try:
        spec = read_spec(args.run)
    except FileNotFoundError as exc:
        raise ConfigError("run", args.run, str(exc)) from None
    try:
        spec, trainer = load_run(args.run, {"run": {**spec.get("run", {}), "sim": {}}})
    except ValueError as exc:
        raise ConfigError("run", args.run, str(exc)) from None
    if isinstance(trainer.policy, SmolVLAPolicy):
        if args.format != "lerobot":
            raise ConfigError("--format", args.format, "a SmolVLA exports in LeRobot's layout only: --format lerobot")
        save = save_smolvla_lerobot
    elif isinstance(trainer.policy, PI0Policy):
        save = save_lerobot if args.format == "lerobot" else save_transformers
    else:
        raise ConfigError("run", args.run, f"holds a {type(trainer.policy).__name__}; ebrl export writes π0 / π0.5 "
                                           "and SmolVLA policies (policy.kind=hf on such a checkpoint)")
    written = save(trainer.policy, out)
    print(f"wrote {written} ({args.format} layout)")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from ebrl.evaluation import EVAL_SEED, evaluate
    from ebrl.runs import load_run, read_spec

    try:
        spec = read_spec(args.run)
    except FileNotFoundError as exc:
        raise ConfigError("run", args.run, str(exc)) from None
    if args.episodes < 1:
        raise ConfigError("--episodes", args.episodes, "must be at least 1")
    overrides: dict[str, Any] = {"run": {**spec.get("run", {}), "sim": {}}}  # one plain env, whatever trained
    if args.env:
        overrides["env"] = args.env
    kwargs = {**spec.get("env_kwargs", {}), **_env_kwargs(args.env_kwarg)}
    if args.video and _renders(spec.get("env", ""), kwargs):
        kwargs.setdefault("render_mode", "rgb_array")
    overrides["env_kwargs"] = kwargs
    try:
        spec, trainer = load_run(args.run, overrides)
    except ValueError as exc:
        raise ConfigError("run", args.run, str(exc)) from None
    env = trainer.env_fn(0)
    try:
        result = evaluate(trainer.policy, env, episodes=args.episodes, seed=EVAL_SEED + args.seed_offset,
                          deterministic=args.deterministic, video=args.video)
    except ValueError as exc:
        raise ConfigError("eval", args.run, str(exc)) from None
    finally:
        env.close()
    lo, hi = result.success_once_ci
    elo, ehi = result.success_at_end_ci
    print(f"{spec['env']}: {result.protocol}")
    print(f"success once {result.success_once:.2f} [{lo:.2f}, {hi:.2f}], at end {result.success_at_end:.2f} "
          f"[{elo:.2f}, {ehi:.2f}]; return {result.mean_return:.2f} +- {result.std_return:.2f}; "
          f"length {result.mean_length:.1f}")
    if len(result.per_task) > 1:
        for task, r in result.per_task.items():
            print(f"  {task}: success once {r['success_once']:.2f}, at end {r['success_at_end']:.2f} "
                  f"({r['episodes']} episodes)")
    if result.video:
        print(f"video: {result.video}")
    if args.json:
        print(json.dumps({k: v for k, v in result.to_dict().items() if k != "returns"}))
    sys.stdout.flush()
    return 0


def _renders(env: str, kwargs: dict[str, Any]) -> bool:
    """Whether ``render_mode='rgb_array'`` gives frames for this env (MuJoCo-based suites without pixels)."""
    return "pixels" not in kwargs and env.split("/")[0] in ("robotics", "mujoco", "metaworld")


def add_parsers(sub) -> None:
    demos = sub.add_parser("demos", help="demonstrations in the LeRobot format")
    demos_sub = demos.add_subparsers(dest="demos_command", required=True)
    c = demos_sub.add_parser("collect", help="episodes of a scripted expert or a trained policy, as a LeRobot dataset")
    c.add_argument("env", help="an env name, e.g. robotics/FetchPush-v4, mock/reach")
    c.add_argument("--policy", default="scripted", help="'scripted' (the env's expert) or a run / sft directory")
    c.add_argument("--episodes", type=int, required=True)
    c.add_argument("--out", required=True, help="a new directory for the dataset")
    c.add_argument("--env-kwarg", action="append", metavar="KEY=VALUE", help="a keyword for the env; repeatable")
    c.add_argument("--seed", type=int, default=1 << 29, help="episode i starts from this seed + i")
    c.add_argument("--only-success", action="store_true", help="keep only episodes with a successful step")
    c.add_argument("--images", choices=("video", "png"), default="video", help="cameras as MP4 (default) or PNG")
    c.set_defaults(fn=cmd_collect)
    s = sub.add_parser("sft", help="behaviour cloning on a LeRobot dataset: a policy RL can start from")
    s.add_argument("dataset", help="a LeRobot dataset directory")
    s.add_argument("--out", required=True, help="the policy directory to write")
    s.add_argument("config", nargs="?", help="a TOML/YAML config (its [policy] and [sft] tables)")
    s.add_argument("--env", help="the env (default: the one the dataset was collected on)")
    s.add_argument("--set", action="append", metavar="KEY=VALUE", help="e.g. policy.kind=token, sft.epochs=50")
    s.add_argument("--quiet", action="store_true")
    s.set_defaults(fn=cmd_sft)
    e = sub.add_parser("eval", help="evaluate a trained policy: success with 95%% intervals, per task, video")
    e.add_argument("run", help="an ebrl train run directory or an ebrl sft output")
    e.add_argument("--env", help="another env than the one it trained on")
    e.add_argument("--env-kwarg", action="append", metavar="KEY=VALUE", help="a keyword for the env; repeatable")
    e.add_argument("--episodes", type=int, default=20)
    e.add_argument("--deterministic", action="store_true", help="the policy's mode instead of samples")
    e.add_argument("--video", metavar="PATH", help="an MP4 (GIF without ffmpeg) of the first episode")
    e.add_argument("--json", action="store_true", help="one JSON object with the result on the last line")
    e.add_argument("--seed-offset", type=int, default=0, help="start from EVAL_SEED + this")
    e.set_defaults(fn=cmd_eval)
    x = sub.add_parser("export", help="write a trained π0 / π0.5 as a LeRobot policy folder or in "
                                      "transformers' layout")
    x.add_argument("run", help="an ebrl train run directory or an ebrl sft output")
    x.add_argument("--format", choices=("lerobot", "transformers"), default="lerobot",
                   help="lerobot: for lerobot-record / lerobot-eval on the robot (default); transformers: "
                        "PI0ForConditionalGeneration plus its processor")
    x.add_argument("--out", required=True, help="a new directory")
    x.set_defaults(fn=cmd_export)
