"""Bring your own VLA: an ``HFTokenPolicy`` with LoRA on a Hugging Face backbone, trained by PPO
through each schedule, each run a fresh process.

The backbone is a Llama causal LM of about 23M parameters (hidden 512, 6 layers, vocabulary
4,096), randomly initialised from its config and saved once with ``save_pretrained`` to a local
directory (``$EBRL_BENCH_VLA_DIR``, default under the system's temporary folder): the policy
loads it by path, as a user's own checkpoint, with LoRA rank 8 on the attention and MLP
projections. The task is ``mock/reach`` (:class:`ebrl.testing.InstructedReach`): 4 targets, the
instruction says which, read through the model's tokenizer in OpenVLA's prompt; each step sleeps
a lognormal 10 ms (sigma 0.5), a simulator's cost that releases the GIL. 8 envs. ``--quick`` (a smoke test) uses a tiny
backbone of the same family instead.

Runners: EBRL ``async``, ``pipelined`` and ``sync``, 3 alternating rounds. Reported per run:
end-to-end env steps/s, generation batch sizes (histogram), and weight publication: bytes per
publication (LoRA's trainable tensors) against the whole state dict (what publishing full
weights would move), and seconds per publication. After the rounds, in this process: the
seconds to snapshot and load one publication, LoRA's against the full state dict's (median of
5 of each, alternating).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from pathlib import Path

from ebrl.algos import PPO
from ebrl.benchmark import Suite
from ebrl.benchmark.figures import Target, check_targets, spread
from ebrl.testing import InstructedReach, Latency

TASKS = 4
BACKBONE = dict(kind="llama", hidden=512, layers=6, heads=8, kv_heads=4, intermediate=1376, vocab=4096)
QUICK_BACKBONE = dict(kind="llama", hidden=32, layers=1, heads=4, kv_heads=2, intermediate=64, vocab=512)
QUICK_ENV = "EBRL_BENCH_VLA_QUICK"  # set by run(quick=True): --quick is a smoke test, on a tiny backbone
LORA_RANK = 8


def model_dir() -> Path:
    """The backbone's directory, written once (atomically: fresh processes may race for it)."""
    backbone = QUICK_BACKBONE if os.environ.get(QUICK_ENV) == "1" else BACKBONE
    key = hashlib.sha1(repr(sorted(backbone.items())).encode()).hexdigest()[:10]
    root = Path(os.environ.get("EBRL_BENCH_VLA_DIR", Path(tempfile.gettempdir()) / "ebrl-bench-vla"))
    path = root / f"llama-{key}"
    if not (path / "config.json").is_file():
        from ebrl.testing import save_random_hf_model

        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=".writing-"))
        sentences = tuple(InstructedReach(tasks=TASKS).instructions())
        save_random_hf_model(tmp, sentences=sentences, **backbone)
        try:
            tmp.rename(path)
        except OSError:  # another process finished first: theirs is the same model
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return path


def reach_env(i: int):
    return InstructedReach(tasks=TASKS, latency=Latency.lognormal(0.010, 0.5))


def policy_fn(obs_space, act_space, seed):
    from ebrl.policies.hf_token import HFTokenPolicy

    words = InstructedReach(tasks=TASKS).instructions()
    return HFTokenPolicy.from_pretrained(model_dir(), obs_space, act_space, lora_rank=LORA_RANK, instruction=words,
                                         seed=seed)


SUITE = Suite(
    description="HFTokenPolicy + LoRA on a 23M-parameter Llama from a local directory, instructed reach (8 envs): "
                "async vs pipelined vs sync, generation batches, publication bytes vs full weights",
    cases={"hf-token-lora": reach_env},
    policy_fn=policy_fn,
    algo_fn=lambda seed: PPO(seed=seed, minibatch_size=64),
    num_envs=8,
    steps=1_024,
    quick_steps=64,
    segment_len=16,
    schedules=("async", "pipelined", "sync"),
    peers=(),
    limits=False,
    targets={"async/sync": 1.5},
    quick_num_envs=2,
)


def publication_seconds(reps: int = 5) -> dict:
    """Seconds to snapshot one publication on the training copy and load it into the acting copy:
    LoRA's trainable tensors against the whole state dict, alternating, ``reps`` of each."""
    from ebrl.policies.base import acting_copy, load_published, published_state
    from ebrl.runtime.learner_process import snapshot

    env = reach_env(0)
    policy = policy_fn(env.observation_space, env.action_space, 0)
    acting = acting_copy(policy)
    times: dict[str, list[float]] = {"lora": [], "full": []}
    for _ in range(reps):
        t0 = time.perf_counter()
        load_published(acting, snapshot(published_state(policy)))
        times["lora"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        acting.load_state_dict(snapshot(policy.state_dict()))
        times["full"].append(time.perf_counter() - t0)
    return {k: spread(v) for k, v in times.items()}


def run(quick: bool, in_process: bool = False) -> dict:
    from ebrl.benchmark.suite import run_suite_rounds

    os.environ[QUICK_ENV] = "1" if quick else "0"  # fresh processes inherit it
    report = run_suite_rounds(SUITE, quick, source=("vla", None), in_process=in_process)
    rows = [r for r in report["rows"] if r.get("publications")]
    figures = {"hf-token-lora: publication bytes full/lora": spread(r["state_bytes"] / r["publish_bytes"] for r in rows)}
    seconds = publication_seconds(2 if quick else 5)
    figures["hf-token-lora: publication seconds full/lora"] = spread(
        [seconds["full"]["median"] / seconds["lora"]["median"]])
    report["ratios"].update(figures)
    report["targets"] += check_targets(figures, {"publication bytes full/lora": Target(20.0)})
    report["publication_seconds"] = seconds
    return report
