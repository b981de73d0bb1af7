"""The ``ebrl`` command: ``ebrl train [CONFIG] [--set key=value ...]`` and ``ebrl bench SUITE``.

With no config, ``ebrl train`` trains the embedded demo: PPO and an MLP on gymnasium's
HalfCheetah-v5 (state observations) for a few minutes, then prints a summary table.

    ebrl train                                        # the demo
    ebrl train my_run.toml --set run.num_envs=32 --set ppo.lr=1e-3
    ebrl train --resume runs/<run>/checkpoint.pt      # continue (Ctrl-C stops a run and saves one)
    ebrl train --set algo=sac  # off-policy: SAC (its own replay buffer, streamed into)
    ebrl train --set algo=rlpd --set rlpd.demos=DIR    # RLPD: SAC with demonstrations (a LeRobot dataset)
    ebrl bench overhead                               # runtime cost per env step
    ebrl bench longtail                               # async vs sync vs pipelined, long-tail envs
    ebrl plot runs/<run>                              # the learning curve as a PNG (also mid-run)

A config file has top-level ``env`` (a registry name, see ``ebrl.envs.make``) and tables
``[run]`` (RunConfig), ``[algo]`` (``kind = "ppo" | "dppo" | "vtrace" | "grpo" | "sac" |
"rlpd"``; ``algo = "sac"`` alone says the same), one table of hyperparameters per algorithm
(``[ppo]`` PPOConfig, ``[dppo]`` DecoupledPPOConfig, ``[vtrace]`` VTraceConfig, ``[grpo]``
GRPOConfig, ``[sac]`` SACConfig, ``[rlpd]`` RLPDConfig: the chosen kind's table is used; SAC and
RLPD give an ``mlp`` or ``cnn`` policy ``action_head = "squashed"`` unless it says otherwise),
``[policy]`` (``kind = "auto" | "mlp" | "cnn" | "token" | "flow"`` and that policy's keywords,
``image_keys``/``state_keys`` included; ``auto`` picks the CNN when the observation has an image
entry, see :mod:`ebrl.policies.encoders`) and ``[env_kwargs]``
(keywords of ``ebrl.envs.make``, e.g. ``pixels = 84``). With ``run.sim.vector_size > 1`` each
group of that many envs is one vector env (``ebrl.envs.make_vector``); ManiSkill tasks are one
GPU vector env of ``run.num_envs`` on a CUDA machine unless set otherwise (on a CPU, one env each).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from ebrl.config import ConfigError
from ebrl.distributed import RankLostError, RanksDivergedError
from ebrl.runs import build_spec, build_trainer

def run_until_signal(trainer, progress=None):
    """``ebrl.run`` on uvloop, where the first SIGINT/SIGTERM stops the run cleanly (no new
    steps, the update in flight finishes) and a second one aborts it. Returns
    ``(result, stopped_by_signal)``; an abort raises ``asyncio.CancelledError``."""
    import signal

    from ebrl.runtime.run import loop_factory, run

    async def main():
        loop, task, stop = asyncio.get_running_loop(), asyncio.current_task(), asyncio.Event()

        def on_signal() -> None:
            if stop.is_set():
                task.cancel()
            else:
                stop.set()
                print("\nebrl: stopping after the update in flight (again to abort)", file=sys.stderr)

        signals = (signal.SIGINT, signal.SIGTERM)
        for sig in signals:
            loop.add_signal_handler(sig, on_signal)
        try:
            return await run(trainer, stop=stop, progress=progress), stop.is_set()
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)

    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main())


def resolve_log_dir(spec: dict[str, Any], cli_log_dir: str | None) -> Path:
    """One directory for everything a run writes: ``run.log_dir`` (``--set`` or the config
    file), else ``--log-dir``, else ``runs/<env>-<time>``."""
    chosen = spec["run"].get("log_dir")
    if chosen is not None:
        if cli_log_dir is not None and Path(cli_log_dir) != Path(chosen):
            print(f"ebrl: run.log_dir={chosen} overrides --log-dir {cli_log_dir}", file=sys.stderr)
        return Path(chosen)
    if cli_log_dir is not None:
        return Path(cli_log_dir)
    slug = spec["env"].replace("/", "-")
    return Path("runs") / f"{slug}-{time.strftime('%Y%m%d-%H%M%S')}"


def rank_argv(argv: list[str]) -> list[str]:
    """A launcher's command line as each rank runs it: ``train ...`` without ``--nproc``.

        >>> rank_argv(["train", "--nproc", "2", "--set", "run.num_envs=8", "--nproc=2"])
        ['train', '--set', 'run.num_envs=8']
    """
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def import_user_module(name: str) -> None:
    """``--import``: a module name (``mylab.policies``) or a ``.py`` file, imported once so that
    what it registers (``ebrl.policies.register_policy``) exists before the run is built."""
    import importlib
    import importlib.util

    from ebrl.runtime.children import send_by_value

    try:
        if name.endswith(".py"):
            path = Path(name).resolve()
            if not path.is_file():
                raise ConfigError("--import", name, "no such file")
            spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[path.stem] = module  # so that its classes pickle by name, as an installed module's do
            spec.loader.exec_module(module)
            send_by_value(module)  # a child that is not forked could not import it by that name
        else:
            importlib.import_module(name)
    except ImportError as exc:
        raise ConfigError("--import", name, f"cannot import it: {exc}") from None


def cmd_train(args: argparse.Namespace) -> int:
    from ebrl import distributed
    from ebrl.checkpoint import load_checkpoint, save_checkpoint
    from ebrl.telemetry import configure_logging
    from ebrl.telemetry.progress import ProgressBar, print_summary

    if args.nproc > 1 and not distributed.in_job():  # the launcher: start the ranks, each runs this again
        from ebrl.launch import launch_local

        return launch_local(args.nproc, rank_argv(args.argv))
    rank = int(os.environ.get("RANK", "0")) if distributed.in_job() else 0
    if args.pin_ranks:  # before anything forks: the rank's sim workers and threads inherit it
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    if "EBRL_LAUNCHER_PID" in os.environ:  # a rank of ebrl's launcher: never outlive it
        from ebrl.runtime.threads import exit_with_parent

        exit_with_parent(int(os.environ["EBRL_LAUNCHER_PID"]))
    for module in args.imports or ():  # a user's policies register themselves on import
        import_user_module(module)
    spec = build_spec(args.config, args.set or [])
    # one directory for the job: rank 0's choice (its clock names it)
    log_dir = Path(distributed.share("log_dir", lambda: str(resolve_log_dir(spec, args.log_dir))))
    spec["run"]["log_dir"] = str(log_dir)  # run() writes history, TensorBoard, result and checkpoints there
    spec["run"].setdefault("checkpoint_every_s", 60.0)  # a crash loses at most a minute
    trainer = build_trainer(spec)
    if args.resume:
        try:
            load_checkpoint(args.resume, trainer)  # sets trainer.env_steps_done
        except (FileNotFoundError, ValueError) as exc:  # missing, not ours, or another policy
            print(f"ebrl: cannot resume: {exc}", file=sys.stderr)
            return 2
        done = trainer.env_steps_done
        remaining = trainer.config.total_env_steps - done
        if remaining <= 0:
            print(f"{args.resume} already has {done:,} of run.total_env_steps={trainer.config.total_env_steps:,}: "
                  "raise it to train on")
            return 0
        trainer.config = dataclasses.replace(trainer.config, total_env_steps=remaining)
    log_dir.mkdir(parents=True, exist_ok=True)
    # the JSON log keeps info events; the console shows warnings only, under the progress bar.
    # In a job every rank logs its events (events.jsonl, events-rank1.jsonl, ...); rank 0 writes
    # the rest and shows progress
    configure_logging("info", json_path=log_dir / ("events.jsonl" if rank == 0 else f"events-rank{rank}.jsonl"),
                      console=True, console_level="warning" if not args.quiet else "error")
    if rank == 0:
        inputs = getattr(trainer.policy, "describe_inputs", None)
        if callable(inputs):  # the observation entries the policy reads, and how (written, never read back)
            spec["policy_inputs"] = inputs()
        (log_dir / "spec.json").write_text(json.dumps(spec, indent=2))
    bar = None if args.quiet or rank else ProgressBar(trainer.config.total_env_steps, desc=spec["env"])
    try:
        result, stopped = run_until_signal(trainer, progress=bar)
    finally:
        if bar is not None:
            bar.close()
    checkpoint = log_dir / "checkpoint.pt"
    env_steps = trainer.env_steps_done + result.env_steps  # counting the runs this one continues (every rank's)
    if rank:
        return 130 if stopped else 0
    save_checkpoint(checkpoint, trainer, env_steps=env_steps, trained=result.trained,
                    updates=result.updates, resumed_from=args.resume, stopped_early=stopped,
                    world_size=result.world_size)
    if callable(getattr(trainer.policy, "save_adapters", None)):  # a LoRA-tuned model: adapters + base path
        trainer.policy.save_adapters(log_dir / "adapters")
    title = f"{spec['env']}: {result.schedule} schedule"
    print_summary(result, title=title + (f", {result.world_size} ranks" if result.world_size > 1 else ""))
    print(f"logs, metrics, result and checkpoint: {log_dir}/  (tensorboard --logdir {log_dir.parent})")
    if stopped:
        print(f"stopped early at {env_steps:,} env steps; continue with: ebrl train ... --resume {checkpoint}")
        return 130
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from ebrl.launch import launch_ray

    if args.nproc < 1:
        raise ConfigError("--nproc", args.nproc, "must be at least 1")
    train_args = [a for a in args.train_args if a != "--"]
    return launch_ray(args.ray or None, args.nproc, rank_argv(["train", *train_args]))


def cmd_bench(args: argparse.Namespace) -> int:
    from ebrl.benchmark.bench import run_suite
    from ebrl.benchmark.loader import list_suites

    if args.list or not args.suite:
        for name, doc in list_suites(args.suites_dir).items():
            print(f"{name:14s} {doc}")
        return 0
    run_suite(args.suite, quick=args.quick, out_dir=Path(args.out), suites_dir=args.suites_dir, trace=args.trace,
              in_process=args.in_process)
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from ebrl.telemetry.plots import default_png, plot_history

    try:
        out = plot_history(args.run, args.out or default_png(args.run), title=args.title)
    except (FileNotFoundError, ValueError) as exc:  # no such run, or nothing to plot yet
        print(f"ebrl: cannot plot: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ebrl", description=__doc__.split("\n\n")[0])
    parser.add_argument("--debug", action="store_true", help="show the traceback of a bad-input error")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train from a TOML/YAML config (default: the HalfCheetah demo)")
    train.add_argument("config", nargs="?", help="TOML or YAML file; omit for the demo")
    train.add_argument("--set", action="append", metavar="KEY=VALUE", help="override, e.g. run.num_envs=32")
    train.add_argument("--log-dir", help="where the run's files go (default runs/<env>-<time>; "
                                         "run.log_dir, when set, wins)")
    train.add_argument("--quiet", action="store_true", help="no progress bar or info logs")
    train.add_argument("--import", dest="imports", action="append", metavar="MODULE",
                       help="import a module or .py file first (it may register policy kinds); repeatable")
    train.add_argument("--resume", metavar="CHECKPOINT", help="continue from a checkpoint.pt up to run.total_env_steps")
    train.add_argument("--nproc", type=int, default=1, metavar="N",
                       help="N data-parallel ranks on this machine (torchrun's agent; see ebrl.distributed)")
    train.add_argument("--pin-ranks", action="store_true",
                       help="each rank on one core of its own (rank r on the r-th allowed core): scaling measurements")
    train.set_defaults(fn=cmd_train)
    launch = sub.add_parser("launch", help="run `ebrl train` as N ranks on a Ray cluster")
    launch.add_argument("--ray", nargs="?", const="", metavar="ADDRESS", required=True,
                        help="the cluster (auto, ray://host:port); no address: a local Ray")
    launch.add_argument("--nproc", type=int, required=True, metavar="N", help="ranks: one per GPU, or per CPU slot")
    launch.add_argument("train_args", nargs=argparse.REMAINDER, help="the arguments of ebrl train")
    launch.set_defaults(fn=cmd_launch)
    bench = sub.add_parser("bench", help="run a bundled benchmark suite")
    bench.add_argument("suite", nargs="?", help="suite name (see --list)")
    bench.add_argument("--list", action="store_true", help="list the suites")
    bench.add_argument("--quick", action="store_true", help="a short run, for smoke tests")
    bench.add_argument("--out", default="bench_out", help="directory for the JSON results")
    bench.add_argument("--trace", action="store_true", help="also write a Chrome trace and a Gantt PNG per schedule")
    bench.add_argument("--suites-dir", default=None, help="where suite files live (default: the repo's bench/)")
    bench.add_argument("--in-process", action="store_true",
                       help="run every measurement in this process (profiling), not each in a fresh one")
    bench.set_defaults(fn=cmd_bench)
    plot = sub.add_parser("plot", help="draw the learning curve of a run, also while it trains")
    plot.add_argument("run", help="a run directory, its history.jsonl or its result.json")
    plot.add_argument("--out", help="PNG path (default: DIR/curve.png for a directory, else next to the file)")
    plot.add_argument("--title")
    plot.set_defaults(fn=cmd_plot)
    from ebrl.cli_demos import add_parsers

    add_parsers(sub)  # demos collect, sft, eval
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a launcher passes on to its ranks
    try:
        return args.fn(args)
    except ConfigError as exc:  # every bad input ends here: one line, exit code 2
        if args.debug:
            raise
        print(f"ebrl: bad configuration: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("ebrl: aborted", file=sys.stderr)
        return 130
    except (RankLostError, RanksDivergedError) as exc:  # a data-parallel job's fault: one line, the launcher names the rank
        if args.debug:
            raise
        print(f"ebrl: {exc}", file=sys.stderr)
        return 1



if __name__ == "__main__":
    sys.exit(main())
