"""The ``ebrl`` command: ``ebrl train [CONFIG] [--set key=value ...]`` and ``ebrl bench SUITE``.

With no config, ``ebrl train`` trains the embedded demo: PPO and an MLP on gymnasium's
HalfCheetah-v5 (state observations) for a few minutes, then prints a summary table.

    ebrl train                                        # the demo
    ebrl train my_run.toml --set run.num_envs=32 --set ppo.lr=1e-3
    ebrl train --resume runs/<run>/checkpoint.pt      # continue (Ctrl-C stops a run and saves one)
    ebrl bench overhead                               # runtime cost per env step
    ebrl bench longtail                               # async vs sync vs pipelined, long-tail envs
    ebrl plot runs/<run>                              # the learning curve as a PNG (also mid-run)

A config file has top-level ``env`` (a registry name, see ``ebrl.envs.make``) and tables
``[run]`` (RunConfig), ``[algo]`` (``kind = "ppo" | "dppo" | "vtrace" | "grpo"``), one table
of hyperparameters per algorithm (``[ppo]`` PPOConfig, ``[dppo]`` DecoupledPPOConfig,
``[vtrace]`` VTraceConfig, ``[grpo]`` GRPOConfig: the chosen kind's table is used),
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
import copy
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from ebrl.config import ConfigError, RunConfig, load_file, parse_setting
from ebrl.distributed import RankLostError, RanksDivergedError

DEMO: dict[str, Any] = {
    "env": "mujoco/HalfCheetah-v5",
    "env_kwargs": {},
    "policy": {},  # each kind's own defaults (the MLP: 64-64 tanh, as CleanRL)
    "algo": {"kind": "ppo"},
    "ppo": {"lr": 3e-4, "minibatch_size": 512, "update_epochs": 4},
    "dppo": {},
    "vtrace": {},
    "grpo": {},
    "sft": {},  # ebrl sft's hyperparameters (ebrl.sft.SFTConfig)
    "run": {"num_envs": 64, "segment_len": 32, "total_env_steps": 1_000_000, "log_every_s": 1.0},
}


def build_spec(config: str | None, overrides: list[str]) -> dict[str, Any]:
    spec = copy.deepcopy(DEMO)
    if config is not None:
        try:
            loaded = load_file(config)
        except ConfigError:
            raise
        except Exception as exc:  # the file's own syntax (tomllib, PyYAML), or it cannot be read
            raise ConfigError("config", str(config), f"cannot read it: {type(exc).__name__}: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError("config", str(config), f"must hold a table of settings, not {type(loaded).__name__}")
        unknown = sorted(set(loaded) - set(DEMO))
        if unknown:
            raise ConfigError(unknown[0], loaded[unknown[0]], f"unknown key; allowed: {', '.join(DEMO)}")
        for key, value in loaded.items():
            spec[key] = {**spec[key], **value} if isinstance(value, dict) else value  # tables merge over the demo
    for item in overrides:
        key, value = parse_setting(item, example="run.num_envs=32")
        head, _, rest = key.partition(".")
        if head not in DEMO:
            raise ConfigError(key, value, f"unknown key; allowed: {', '.join(DEMO)} (tables take table.field)")
        if rest:
            if not isinstance(spec[head], dict):
                raise ConfigError(key, value, f"{head} is not a table")
            spec[head][rest] = value
        else:
            spec[head] = value
    return spec


ALGO_KINDS = ("ppo", "dppo", "vtrace", "grpo")


def build_policy(observation_space, action_space, options: dict[str, Any]):
    """``policy.kind``: ``mlp`` (vectors), ``cnn`` (observations with images), ``token`` (action
    tokens, :class:`~ebrl.policies.TokenPolicy`), ``flow`` (flow-matching chunks,
    :class:`~ebrl.policies.FlowPolicy`), ``hf`` (the Hugging Face checkpoint in the local directory
    ``policy.path``, by its ``model_type``: π0 / π0.5 as they are, an LM with action tokens,
    :func:`ebrl.policies.from_pretrained`), ``hf-token`` (action tokens on a Hugging Face model
    from ``policy.path``), ``hf-flow`` (a flow-matching action expert on one), a kind
    registered with :func:`ebrl.policies.register_policy`, or ``auto`` (the CNN whenever the observation has an image entry, else the MLP); the other
    ``[policy]`` keys go to the kind's builder."""
    from gymnasium import spaces

    from ebrl.policies.encoders import ObsLayout
    from ebrl.policies.registry import policy_builder, policy_kinds

    options = dict(options)
    kind = options.pop("kind", "auto")
    if kind == "auto":
        try:
            layout = ObsLayout.from_space(observation_space, image_keys=options.get("image_keys"),
                                          state_keys=options.get("state_keys"))
        except ValueError as exc:  # an entry nothing reads, named
            if isinstance(observation_space, spaces.Dict):
                raise ConfigError("policy.kind", kind, str(exc)) from None
            layout = ObsLayout()  # a Box that is not an image: the MLP reads it whole, as it always did
        kind = "cnn" if layout.images else "mlp"
    try:
        builder = policy_builder(kind)
    except KeyError:
        raise ConfigError("policy.kind", kind, f"must be one of {', '.join(policy_kinds())}") from None
    try:
        return builder(observation_space, action_space, **options)
    except TypeError as exc:  # an unknown keyword for this policy
        raise ConfigError("policy", options, f"{kind}: {exc}") from None
    except (ValueError, FileNotFoundError) as exc:  # spaces this policy cannot read, a missing model
        raise ConfigError("policy.kind", kind, str(exc)) from None


DEMO_KEYS = ("demos", "demo_coef", "demo_decay")  # a kind's table: the demonstrations kept in RL's loss


def build_algo(spec: dict[str, Any], observation_space=None, action_space=None):
    """``algo.kind`` and that kind's table of hyperparameters (``[ppo]``, ``[dppo]``, ...), where
    ``demos`` (a LeRobot dataset directory), ``demo_coef`` and ``demo_decay`` build the
    algorithm's :class:`~ebrl.algos.demo_loss.DemoLoss` for a policy acting in these spaces."""
    from ebrl.algos import GRPO, PPO, DecoupledPPO, VTrace
    from ebrl.algos.demo_loss import DemoLoss

    unknown = sorted(set(spec["algo"]) - {"kind"})
    if unknown:
        raise ConfigError(f"algo.{unknown[0]}", spec["algo"][unknown[0]],
                          "unknown key: [algo] holds only kind; hyperparameters go in the kind's own table, "
                          "e.g. grpo.lr=1e-4")
    kind = spec["algo"].get("kind", "ppo")
    if kind not in ALGO_KINDS:
        raise ConfigError("algo.kind", kind, f"must be one of {', '.join(ALGO_KINDS)}")
    cls = {"ppo": PPO, "dppo": DecoupledPPO, "vtrace": VTrace, "grpo": GRPO}[kind]
    table = dict(spec[kind])
    demo = {k: table.pop(k) for k in DEMO_KEYS if k in table}
    demos = None
    if demo:
        if "demos" not in demo:
            key = next(iter(demo))
            raise ConfigError(f"{kind}.{key}", demo[key], f"weighs the demonstrations in RL's loss: set {kind}.demos "
                              "to a LeRobot dataset directory (ebrl demos collect writes one)")
        if observation_space is None:
            raise ValueError("build_algo: demos need the env's observation and action spaces")
        try:
            weights = {k.removeprefix("demo_"): v for k, v in demo.items() if k != "demos"}  # else DemoLoss's defaults
            demos = DemoLoss(demo["demos"], observation_space, action_space, seed=table.get("seed", 0), **weights)
        except ConfigError as exc:  # a bad weight
            raise ConfigError(f"{kind}.{exc.field}", exc.value, exc.allowed) from None
        except (ValueError, FileNotFoundError) as exc:  # a dataset these spaces cannot read
            raise ConfigError(f"{kind}.demos", demo["demos"], str(exc)) from None
    try:
        return cls(**table, demos=demos)
    except (TypeError, ValueError) as exc:  # an unknown key, or a value the config refuses
        raise ConfigError(kind, spec[kind], str(exc)) from None


def build_trainer(spec: dict[str, Any]):
    import ebrl
    from ebrl.algos import resolve_run_config
    from ebrl.envs import make, make_vector, natively_vectorised
    from ebrl.runtime.env_facts import EnvFacts

    name, env_kwargs = spec["env"], dict(spec["env_kwargs"])
    run = dict(spec["run"])
    sim = run.get("sim", {})
    if not isinstance(sim, dict):  # e.g. JSON where TOML's inline table was meant
        raise ConfigError("run.sim", sim, "must be a table: --set 'run.sim={backend=\"process\", num_workers=2}' "
                          "or --set run.sim.backend=process")
    sim = dict(sim)
    if natively_vectorised(name, **env_kwargs) and sim.get("vector_size", 1) == 1:
        sim["vector_size"] = run.get("num_envs", RunConfig.num_envs)  # one GPU simulator for every env
        run["sim"] = sim
    run_cfg = RunConfig().with_overrides(run)
    size = run_cfg.sim.vector_size

    def env_fn(i: int):
        return make_vector(name, size, **env_kwargs) if size > 1 else make(name, **env_kwargs)

    try:
        probe = env_fn(0)
    except ValueError as exc:  # an unknown name (its close matches named), or env_kwargs it refuses
        raise ConfigError("env", name, str(exc)) from None
    except TypeError as exc:  # a keyword the env does not take
        raise ConfigError("env_kwargs", env_kwargs, str(exc)) from None
    options, init = policy_options(spec["policy"])
    asked = "freeze_obs_stats" in options
    freeze = options.pop("freeze_obs_stats", init is not None)
    if not isinstance(freeze, bool):
        raise ConfigError("policy.freeze_obs_stats", freeze, "must be true or false")
    std_scale = options.pop("init_std_scale", None)
    if std_scale is not None and init is None:
        raise ConfigError("policy.init_std_scale", std_scale, "scales the std loaded from policy.init: set that too "
                          "(from scratch, policy.init_log_std sets the std)")
    try:
        facts = EnvFacts.of(probe)
        policy = build_policy(facts.observation_space, facts.action_space, with_env_instructions(options, probe))
    finally:
        probe.close()
    if init is not None:  # an ebrl sft output (or another run): RL starts from its weights
        from ebrl.runs import load_policy_weights, scale_std

        try:
            load_policy_weights(init, policy)
        except (ValueError, FileNotFoundError) as exc:
            raise ConfigError("policy.init", init, str(exc)) from None
        if std_scale is not None:
            try:
                scale_std(policy, std_scale)
            except ValueError as exc:
                raise ConfigError("policy.init_std_scale", std_scale, str(exc)) from None
    if freeze:  # by default with policy.init: RL keeps the statistics its start weights were fitted to
        if callable(getattr(policy, "freeze_obs_stats", None)):
            policy.freeze_obs_stats()
        elif asked:
            raise ConfigError("policy.freeze_obs_stats", freeze, f"{type(policy).__name__} keeps no observation "
                              "statistics")
    algo = build_algo(spec, facts.observation_space, facts.action_space)
    # as ebrl.run() resolves it, here already so that trainer.config says what runs: the
    # algorithm's needs (GRPO: sync, episode cuts, reset groups, segments of the time limit)
    run_cfg = resolve_run_config(run_cfg, algo, facts.max_episode_steps)
    return ebrl.Trainer(env_fn=env_fn, policy=policy, algo=algo, config=run_cfg)


def policy_options(options: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """``[policy]`` without ``init``, and ``init``: the directory of an ``ebrl sft`` output or a run
    whose weights RL starts from. Its ``[policy]`` table is the default under the one given (the
    same kind, sizes and backbone path, unless set here)."""
    options = dict(options)
    init = options.pop("init", None)
    if init is None:
        return options, None
    from ebrl.runs import read_spec

    try:
        saved = read_spec(init).get("policy", {})
    except FileNotFoundError as exc:
        raise ConfigError("policy.init", init, str(exc)) from None
    return {**{k: v for k, v in saved.items() if k != "init"}, **options}, str(init)


def with_env_instructions(options: dict[str, Any], env) -> dict[str, Any]:
    """A language-conditioned policy (``hf``, ``hf-token``, ``hf-flow``) without ``policy.instruction``
    reads the env's own words: ``env.instructions()`` (LIBERO, ``mock/reach``), one per value of its Discrete
    ``instruction`` entry, or a single string when it has one task."""
    if options.get("kind") not in ("hf", "hf-token", "hf-flow") or "instruction" in options:
        return options
    try:
        said = list(env.get_wrapper_attr("instructions")())
    except AttributeError:
        return options
    spaces = getattr(env.observation_space, "spaces", {})
    return {**options, "instruction": said if "instruction" in spaces or len(said) != 1 else said[0]}


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
    from ebrl.benchmark.loader import list_suites, run_suite

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
