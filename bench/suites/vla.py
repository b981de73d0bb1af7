"""Bring your own VLA: an ``HFTokenPolicy`` with LoRA on a Hugging Face backbone, and a user's π0
and π0.5 checkpoints (``PI0Policy``) with LoRA, trained by PPO through each schedule, each run a
fresh process.

The backbone is a Llama causal LM of about 23M parameters (hidden 512, 6 layers, vocabulary
4,096), randomly initialised from its config and saved once with ``save_pretrained`` to a local
directory (``$EBRL_BENCH_VLA_DIR``, default under the system's temporary folder): the policy
loads it by path, as a user's own checkpoint, with LoRA rank 8 on the attention and MLP
projections. The task is ``mock/reach`` (:class:`ebrl.testing.InstructedReach`): 4 targets, the
instruction says which, read through the model's tokenizer in OpenVLA's prompt; each step sleeps
a lognormal 10 ms (sigma 0.5), a simulator's cost that releases the GIL. 8 envs. ``--quick`` (a smoke test) uses a tiny
backbone of the same family instead, and runs ``async`` and ``sync`` only.

The π0 and π0.5 cases (``pi0-lora``, ``pi05-lora``) load tiny random checkpoints
(:func:`ebrl.testing.save_random_pi0`: a 2-layer Gemma of width 64, a SigLIP tower reading
32-pixel images in 16 patches, an expert of width 48, chunks of 8 actions, 4 denoising steps)
written once to the same folder, with LoRA rank 8, πRL's Flow-Noise, and 4 actions of each chunk
executed per decision (``execute=4``: ``ebrl.run`` executes the chunk on the per-step env), 128
decisions a run: one update, so their rows measure what a call and a publication cost, not a
long run's throughput. The SmolVLA case (``smolvla-lora``) is the same with a tiny random SmolVLA
folder (:func:`ebrl.testing_smolvla.save_random_smolvla`: a 6-layer SmolVLM of width 32 cut to 4,
cameras ``top`` and ``wrist`` resized with padding to 32 pixels, chunks of 8 actions, 4 steps) and
its VLM directory. The
env is the same reach with two cameras of different sizes (``top`` 32x32, ``wrist`` 24x40: the
point drawn where it is), so the model reads two images, its state and the instruction.

Runners: EBRL ``async``, ``pipelined`` and ``sync``, 3 alternating rounds. Reported per run:
end-to-end env steps/s, generation batch sizes (histogram), and weight publication: bytes per
publication (LoRA's trainable tensors) against the whole state dict (what publishing full
weights would move), and seconds per publication. After the rounds, in this process: the
seconds to snapshot and load one publication, LoRA's against the full state dict's (median of
5 of each, alternating), and each π0-family policy's milliseconds per ``act`` call at batch sizes
1, 4 and 16 (median of 5 calls after a warm-up; ``--quick``: one call at 1 and 4).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from pathlib import Path

import gymnasium as gym
import numpy as np

from ebrl.algos import PPO
from ebrl.benchmark import Suite
from ebrl.benchmark.figures import Target, check_targets, spread
from ebrl.testing import InstructedReach, Latency

TASKS = 4
BACKBONE = dict(kind="llama", hidden=512, layers=6, heads=8, kv_heads=4, intermediate=1376, vocab=4096)
QUICK_BACKBONE = dict(kind="llama", hidden=32, layers=1, heads=4, kv_heads=2, intermediate=64, vocab=512)
QUICK_ENV = "EBRL_BENCH_VLA_QUICK"  # set by run(quick=True): --quick is a smoke test, on a tiny backbone
LORA_RANK = 8
PI0_KINDS = {"pi0-lora": "pi0", "pi05-lora": "pi05"}
PI0_MODEL = dict(state_dim=4, action_dim=2, chunk_size=8, image_size=32, patch_size=8, hidden=64, expert_hidden=48,
                 layers=2, heads=2, head_dim=32, num_steps=4, max_dim=8)
EXECUTE = 4  # actions of each 8-action chunk executed per decision (πRL's replanning)
CALL_BATCHES = (1, 4, 16)
SMOLVLA_MODEL = dict(state_dim=4, action_dim=2, chunk_size=8, image_size=32, num_steps=4, max_dim=8,
                     camera_names=("top", "wrist"))
FLOW_CASES = (*PI0_KINDS, "smolvla-lora")  # the cases whose act is timed per batch size


def _written_once(name: str, settings: dict, write) -> Path:
    """A model directory ``write(path)`` fills, written once per settings (atomically: fresh
    processes may race for it)."""
    key = hashlib.sha1(repr(sorted(settings.items())).encode()).hexdigest()[:10]
    root = Path(os.environ.get("EBRL_BENCH_VLA_DIR", Path(tempfile.gettempdir()) / "ebrl-bench-vla"))
    path = root / f"{name}-{key}"
    if not (path / "config.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=".writing-"))
        write(tmp)
        try:
            tmp.rename(path)
        except OSError:  # another process finished first: theirs is the same model
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return path


def model_dir() -> Path:
    """The token policy's backbone."""
    from ebrl.testing import save_random_hf_model

    backbone = QUICK_BACKBONE if os.environ.get(QUICK_ENV) == "1" else BACKBONE
    sentences = tuple(InstructedReach(tasks=TASKS).instructions())
    return _written_once("llama", backbone, lambda p: save_random_hf_model(p, sentences=sentences, **backbone))


def pi0_dir(kind: str) -> Path:
    """A tiny random π0 (``kind="pi0"``) or π0.5 (``"pi05"``) checkpoint."""
    from ebrl.testing import save_random_pi0

    settings = dict(PI0_MODEL, kind=kind)
    return _written_once(kind, settings, lambda p: save_random_pi0(p, **settings))


class TwoCameras(gym.ObservationWrapper):
    """The reach seen by two cameras of different sizes: a white dot where the point is."""

    SIZES = {"top": (32, 32), "wrist": (24, 40)}

    def __init__(self, env: InstructedReach):
        super().__init__(env)
        cams = {k: gym.spaces.Box(0, 255, (h, w, 3), np.uint8) for k, (h, w) in self.SIZES.items()}
        self.observation_space = gym.spaces.Dict({**env.observation_space.spaces, **cams})

    def observation(self, obs: dict) -> dict:
        x, y = np.clip(obs["state"][:2], -1.0, 1.0)
        out = dict(obs)
        for key, (h, w) in self.SIZES.items():
            img = np.zeros((h, w, 3), np.uint8)
            img[int((y + 1) / 2 * (h - 1)), int((x + 1) / 2 * (w - 1))] = 255
            out[key] = img
        return out


def smolvla_dir() -> Path:
    """A tiny random SmolVLA folder, its VLM directory beside it as ``vlm``."""
    from ebrl.testing_smolvla import save_random_smolvla

    return _written_once("smolvla", SMOLVLA_MODEL, lambda p: save_random_smolvla(p, p / "vlm", **SMOLVLA_MODEL))


def smolvla_policy_fn(obs_space, act_space, seed):
    from ebrl.policies.smolvla.policy import SmolVLAPolicy

    path = smolvla_dir()
    words = InstructedReach(tasks=TASKS).instructions()
    return SmolVLAPolicy.from_pretrained(path, obs_space, act_space, vlm=path / "vlm", lora_rank=LORA_RANK,
                                         execute=EXECUTE, instruction=words, seed=seed)


def camera_reach_env(i: int):
    return TwoCameras(InstructedReach(tasks=TASKS, latency=Latency.lognormal(0.010, 0.5)))


def pi0_policy_fn(kind: str):
    def build(obs_space, act_space, seed):
        from ebrl.policies.pi0.policy import PI0Policy

        words = InstructedReach(tasks=TASKS).instructions()
        return PI0Policy.from_pretrained(pi0_dir(kind), obs_space, act_space, lora_rank=LORA_RANK, execute=EXECUTE,
                                         instruction=words, seed=seed)
    return build


def reach_env(i: int):
    return InstructedReach(tasks=TASKS, latency=Latency.lognormal(0.010, 0.5))


def policy_fn(obs_space, act_space, seed):
    from ebrl.policies.hf_token import HFTokenPolicy

    words = InstructedReach(tasks=TASKS).instructions()
    return HFTokenPolicy.from_pretrained(model_dir(), obs_space, act_space, lora_rank=LORA_RANK, instruction=words,
                                         seed=seed)


SUITE = Suite(
    description="HFTokenPolicy + LoRA on a 23M-parameter Llama, and tiny π0 / π0.5 / SmolVLA checkpoints + LoRA "
                "with two cameras, from local directories, instructed reach (8 envs): async vs pipelined vs sync, "
                "generation batches, publication bytes vs full weights, ms per policy call against batch size",
    cases={"hf-token-lora": reach_env, **{case: camera_reach_env for case in FLOW_CASES}},
    policy_fn=policy_fn,
    case_policies={**{case: pi0_policy_fn(kind) for case, kind in PI0_KINDS.items()},
                   "smolvla-lora": smolvla_policy_fn},
    case_sizes={case: (8, 128) for case in FLOW_CASES},  # one update a run: the suite stays within 25 minutes
    algo_fn=lambda seed: PPO(seed=seed, minibatch_size=64),
    num_envs=8,
    steps=1_024,
    quick_steps=32,  # --quick is a smoke test: 32 steps a run
    segment_len=16,
    schedules=("async", "pipelined", "sync"),
    quick_schedules=("async", "sync"),  # a smoke test: the π0-family runs cost seconds each on a CPU
    peers=(),
    limits=False,
    targets={"async/best schedule": 0.97, "async/sync": 1.5},
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


def call_ms(case: str, reps: int = 5, batches: tuple[int, ...] = CALL_BATCHES) -> dict[str, dict]:
    """Milliseconds per ``act`` call of a π0-family case's policy, per batch size (median of
    ``reps`` calls after one warm-up call)."""
    env = camera_reach_env(0)
    policy = SUITE.for_case(case).policy_fn(env.observation_space, env.action_space, 0)
    obs, _ = env.reset(seed=0)
    out = {}
    for batch in batches:
        rows = {k: np.repeat(np.asarray(v)[None], batch, axis=0) for k, v in obs.items()}
        policy.act(rows)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            policy.act(rows)
            times.append((time.perf_counter() - t0) * 1e3)
        out[str(batch)] = spread(times)
    return out


def run(quick: bool, in_process: bool = False) -> dict:
    from ebrl.benchmark.suite import run_suite_rounds

    os.environ[QUICK_ENV] = "1" if quick else "0"  # fresh processes inherit it
    report = run_suite_rounds(SUITE, quick, source=("vla", None), in_process=in_process)
    figures = {}
    for case in SUITE.cases:
        rows = [r for r in report["rows"] if r["case"] == case and r.get("publications")]
        figures[f"{case}: publication bytes full/lora"] = spread(r["state_bytes"] / r["publish_bytes"] for r in rows)
    seconds = publication_seconds(2 if quick else 5)
    figures["hf-token-lora: publication seconds full/lora"] = spread(
        [seconds["full"]["median"] / seconds["lora"]["median"]])
    report["ratios"].update(figures)
    report["targets"] += check_targets(figures, {"hf-token-lora: publication bytes full/lora": Target(20.0)})
    report["publication_seconds"] = seconds
    # --quick: one call per size, the two smaller sizes (a smoke test; batch 16 costs seconds a call on a CPU)
    report["call_ms"] = {case: call_ms(case, 1, CALL_BATCHES[:2]) if quick else call_ms(case) for case in FLOW_CASES}
    return report
