"""A run from its spec: built from a config file and ``--set`` overrides
(:func:`build_spec`, :func:`build_trainer`), or read back from its directory.

An ``ebrl train`` run and an ``ebrl sft`` output both hold ``spec.json`` (the env, its keywords and the ``[policy]`` table it was built with)
and ``checkpoint.pt`` (the policy's weights; only what trains for a LoRA-tuned backbone, whose
base is loaded again from ``policy.path``). :func:`load_run` rebuilds the policy from the spec
and loads the weights; ``ebrl eval``, ``ebrl demos collect --policy DIR`` and
``ebrl train --set policy.init=DIR`` go through it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

from ebrl.config import ConfigError, RunConfig, load_file, parse_setting

SPEC, CHECKPOINT = "spec.json", "checkpoint.pt"

DEMO: dict[str, Any] = {
    "env": "mujoco/HalfCheetah-v5",
    "env_kwargs": {},
    "policy": {},  # each kind's own defaults (the MLP: 64-64 tanh, as CleanRL)
    "algo": {"kind": "ppo"},
    "ppo": {},  # PPOConfig's defaults (lr 3e-4, minibatches of 512, 4 epochs), under a policy's RL_DEFAULTS
    "dppo": {},
    "vtrace": {},
    "grpo": {},
    "sac": {},  # SACConfig's defaults; the policy gets action_head="squashed" (SAC's tanh Gaussian)
    "rlpd": {},  # RLPDConfig's: SAC's with LayerNorm critics, an ensemble, UTD 20; rlpd.demos=DIR
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
    if isinstance(spec["algo"], str):  # algo=sac: the kind alone
        spec["algo"] = {"kind": spec["algo"]}
    return spec


ALGO_KINDS = ("ppo", "dppo", "vtrace", "grpo", "sac", "rlpd")
OFF_POLICY = ("sac", "rlpd")  # their demos go to a replay buffer of their own, not to DemoLoss


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
    # method="dsrl": the flow policy frozen on its ODE, an actor steering its initial noise
    steer = {k: options.pop(k) for k in DSRL_KEYS if k in options} if options.get("method") == "dsrl" else None
    if steer is not None:
        options["method"] = "ode"
    try:
        policy = builder(observation_space, action_space, **options)
        if steer is None:
            return policy
        from ebrl.policies.dsrl import DSRLPolicy

        return DSRLPolicy(policy, noise_bound=steer.get("noise_bound", 1.0),
                          hidden=tuple(steer.get("steer_hidden", (256, 256))))
    except TypeError as exc:  # an unknown keyword for this policy
        raise ConfigError("policy", options, f"{kind}: {exc}") from None
    except (ValueError, FileNotFoundError) as exc:  # spaces this policy cannot read, a missing model
        raise ConfigError("policy.kind", kind, str(exc)) from None


DSRL_KEYS = ("noise_bound", "steer_hidden")  # [policy] with method="dsrl": DSRLPolicy's noise_bound and hidden
DEMO_KEYS = ("demos", "demo_coef", "demo_decay")  # a kind's table: the demonstrations kept in RL's loss


def build_algo(spec: dict[str, Any], observation_space=None, action_space=None, policy=None,
               time_limit: int | None = None):
    """``algo.kind`` and that kind's table of hyperparameters (``[ppo]``, ``[dppo]``, ...), where
    ``demos`` (a LeRobot dataset directory), ``demo_coef`` and ``demo_decay`` build the
    algorithm's :class:`~ebrl.algos.demo_loss.DemoLoss` for a policy acting in these spaces; for
    ``sac`` and ``rlpd``, ``demos`` fills the algorithm's demonstration buffer instead (RLPD's
    half of every minibatch; ``time_limit``, the env's, tells a time limit from a termination).
    A ``policy`` whose class names ``RL_DEFAULTS`` (a pretrained VLA's learning rates and critic
    warm-up: :class:`~ebrl.policies.pi0.policy.PI0Policy`) gets those of its keys the algorithm has,
    under the table's own; ``spec`` then holds what runs (``spec.json`` says it)."""
    from ebrl.algos import GRPO, PPO, RLPD, SAC, DecoupledPPO, VTrace
    from ebrl.algos.demo_loss import DemoLoss

    unknown = sorted(set(spec["algo"]) - {"kind"})
    if unknown:
        raise ConfigError(f"algo.{unknown[0]}", spec["algo"][unknown[0]],
                          "unknown key: [algo] holds only kind; hyperparameters go in the kind's own table, "
                          "e.g. grpo.lr=1e-4")
    kind = spec["algo"].get("kind", "ppo")
    if kind not in ALGO_KINDS:
        raise ConfigError("algo.kind", kind, f"must be one of {', '.join(ALGO_KINDS)}")
    cls = {"ppo": PPO, "dppo": DecoupledPPO, "vtrace": VTrace, "grpo": GRPO, "sac": SAC, "rlpd": RLPD}[kind]
    fields = {f.name for f in dataclasses.fields(cls().config)}
    family = {k: v for k, v in getattr(policy, "RL_DEFAULTS", {}).items() if k in fields}
    spec[kind] = table = {**family, **spec[kind]}
    table = dict(table)
    if kind in OFF_POLICY:
        return _off_policy(cls, kind, table, spec, observation_space, action_space, policy, time_limit)
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


def _off_policy(cls, kind: str, table: dict[str, Any], spec: dict[str, Any], observation_space, action_space,
                policy, time_limit: int | None):
    """SAC or RLPD from its table; ``demos`` (a LeRobot dataset directory) loaded into its
    demonstration buffer, as transitions of the policy's action shape."""
    demos = table.pop("demos", None)
    try:
        algo = cls(**table)
    except (TypeError, ValueError) as exc:  # an unknown key, or a value the config refuses
        raise ConfigError(kind, spec[kind], str(exc)) from None
    if policy is not None and not getattr(policy, "squashed", False):
        raise ConfigError("policy.action_head", getattr(policy, "action_head", "gaussian"),
                          f"{kind} needs 'squashed' (SAC's tanh Gaussian on policy.kind mlp or cnn)")
    if demos is not None:
        if observation_space is None:
            raise ValueError("build_algo: demos need the env's observation and action spaces")
        from ebrl.sft import demo_shape

        shape = demo_shape(policy, action_space) if policy is not None else tuple(action_space.shape)
        try:
            algo.load_demos(demos, observation_space, shape, time_limit=time_limit)
        except (ValueError, KeyError, FileNotFoundError) as exc:  # a dataset these spaces cannot read
            raise ConfigError(f"{kind}.demos", demos, str(exc)) from None
    return algo


def build_trainer(spec: dict[str, Any]):
    import ebrl
    from ebrl.algos import resolve_run_config
    from ebrl.envs import make, make_vector, natively_vectorised
    from ebrl.runtime.env_facts import EnvFacts
    from ebrl.sft import carry_reward_scale

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
    if (spec["algo"].get("kind") in OFF_POLICY and options.get("kind", "auto") in ("auto", "mlp", "cnn")
            and "action_head" not in options):  # SAC's actor: the tanh Gaussian head (spec.json says so)
        options["action_head"] = spec["policy"]["action_head"] = "squashed"
    try:
        facts = EnvFacts.of(probe)
        policy = build_policy(facts.observation_space, facts.action_space, with_env_instructions(options, probe))
    finally:
        probe.close()
    if init is not None:  # an ebrl sft output (or another run): RL starts from its weights
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
    algo = build_algo(spec, facts.observation_space, facts.action_space, policy, facts.max_episode_steps)
    if init is not None:
        carry_reward_scale(algo, init)
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


def read_spec(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not (path / SPEC).is_file() or not (path / CHECKPOINT).is_file():
        raise FileNotFoundError(f"{path} is not a run or policy directory: it needs {SPEC} and {CHECKPOINT} "
                                "(written by ebrl train and ebrl sft)")
    return json.loads((path / SPEC).read_text())


def load_policy_weights(path: str | Path, policy) -> dict[str, Any]:
    """Load ``checkpoint.pt``'s policy weights (not the algorithm's state) into ``policy``; returns its meta."""
    from ebrl.checkpoint import FORMAT, load_safely
    from ebrl.policies.base import load_published

    file = Path(path) / CHECKPOINT if Path(path).is_dir() else Path(path)
    data = load_safely(file)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{file} is not an EBRL checkpoint (format {FORMAT})")
    ours = type(policy).__name__
    if data["policy_class"] != ours:
        raise ValueError(f"{file} holds a {data['policy_class']}, this policy is a {ours}: build it with the "
                         f"same policy.kind")
    try:
        load_published(policy, data["policy"])
    except RuntimeError as exc:
        raise ValueError(f"{file} does not fit this {ours}: {exc}") from None
    return data["meta"]


def scale_std(policy, scale: float) -> None:
    """Multiply a Gaussian policy's standard deviation by ``scale`` (``log_std += log(scale)``): RL
    from a clone whose ``log_std`` SFT fitted to its held-out error samples a policy worse than its
    mode, and RL learns from what it samples (``policy.init_std_scale``, docs/demos.md)."""
    import math

    import torch

    log_std = getattr(policy, "log_std", None)
    if not isinstance(log_std, torch.nn.Parameter):
        raise ValueError(f"{type(policy).__name__} has no Gaussian log_std to scale")
    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"the scale must be a positive number, not {scale!r}")
    with torch.no_grad():
        log_std.add_(math.log(scale))


def load_run(path: str | Path, overrides: dict[str, Any] | None = None):
    """``(spec, trainer)`` of the run or policy directory ``path``, its weights in ``trainer.policy``.

    ``overrides``: top-level spec keys to replace (``env_kwargs`` for an eval env that renders).
    """
    spec = {**read_spec(path), **(overrides or {})}
    spec.setdefault("algo", {"kind": "ppo"})
    trainer = build_trainer(spec)
    load_policy_weights(path, trainer.policy)
    return spec, trainer
