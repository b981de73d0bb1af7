"""RLPD (ebrl/algos/sac.py) learns a sparse-reward reach from a few scripted demonstrations where
SAC without them does not, on the thread learner in virtual time and on the learner process."""

from __future__ import annotations

import pytest

import ebrl
from ebrl.algos import RLPD, SAC
from ebrl.policies import MLPPolicy
from ebrl.testing import RingReach, run_episodes, run_virtual, torch_threads

STEPS = 2_000  # env steps, the same budget for both
DEMOS, DEMO_SEED = 20, 1_000  # expert episodes, about 7 steps each (130-145 transitions)
EVAL_SEEDS = range(10_000, 10_048)
# both algorithms, as tests/test_sac.py's SAC learns the dense reach (learning_starts scaled to the budget)
SHARED = {"batch_size": 128, "learning_starts": 250, "critic_hidden": (64, 64), "init_alpha": 0.1}
RLPD_ON_CPU = {"utd_ratio": 2.0}  # RLPD's 20 would take 35,000 gradient steps: minutes on one core
MARGIN = 0.3  # RLPD's success rate over SAC's


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def success_rate(policy) -> float:
    """The share of the episodes on ``EVAL_SEEDS`` that the policy's mode ends at the target."""
    return float(run_episodes(policy, [RingReach(sparse=True) for _ in EVAL_SEEDS], EVAL_SEEDS)[1].mean())


def train(name: str, learner: str, seed: int = 0) -> tuple[float, SAC]:
    """``name`` ("sac", or "rlpd" with ``DEMOS`` expert episodes) on the sparse reach for ``STEPS``
    env steps: the trained mode's success rate, and the algorithm."""
    probe = RingReach(sparse=True)
    policy = MLPPolicy.from_spaces(probe.observation_space, probe.action_space, action_head="squashed",
                                   activation="relu", seed=seed)
    if name == "sac":
        algo = SAC(seed=seed, **SHARED)
    else:
        algo = RLPD(seed=seed, **SHARED, **RLPD_ON_CPU)
        algo.load_demos(probe.expert_demos(DEMOS, DEMO_SEED + seed), probe.observation_space,
                        probe.action_space.shape, time_limit=probe.episode_len)
    trainer = ebrl.Trainer(lambda i: RingReach(sparse=True), policy, algo,
                           ebrl.RunConfig(num_envs=4, segment_len=8, total_env_steps=STEPS, seed=seed,
                                          **({} if learner == "virtual" else {
                                              "schedule": "sync", "learner": "process",
                                              "sim": {"backend": "inline"}})))
    res = run_virtual(trainer) if learner == "virtual" else ebrl.run_sync(trainer)
    assert res.accounting_ok() and res.env_steps == STEPS
    assert learner == "virtual" or res.learner_mode == "process"
    assert all(h["demo_fraction"] == 0.5 for h in res.history if h["gradient_steps"]) == (name == "rlpd")
    return success_rate(policy), algo


@pytest.mark.timeout(400)  # the process learner's real run took 189 s once, on a machine loaded by other tests
@pytest.mark.parametrize("learner", ["virtual", pytest.param("process", marks=pytest.mark.slow)])
def test_rlpd_with_demonstrations_beats_sac_on_a_sparse_reach(learner):
    """:class:`~ebrl.testing.RingReach` with ``sparse=True`` (reward 1 at the target, which ends
    the episode; 0 elsewhere), 4 envs in segments of 8, 2,000 env steps each: SAC explores
    without a reward to follow (uniformly random actions reach the target in about one episode
    of 300), RLPD samples half of each minibatch from 20 episodes of the scripted expert.

    Both with ``SHARED``'s settings; RLPD at its own otherwise (10 LayerNorm critics, 2 of them
    in the target, the actor on the ensemble's mean, the symmetric sampling) except
    ``RLPD_ON_CPU``: 2 gradient steps per transition, not 20, so that its run takes about 25 s on
    one core (3,552 gradient steps, about 7 ms each; SAC's 1,776 take about 6 s). The test takes
    about 35 s on a 2-core machine shared with other work, on either learner (the learner
    process's runs are real ones: its RLPD run took 64 s beside a busy loop on one of the cores).

    Measured (the mode's success on 48 fixed seeds; seeds 0-4 of policy, algorithm, run and
    demonstrations): RLPD 0.69, 0.67, 0.46, 0.48, 0.54; SAC 0.00 in every seed (0.00 too at 2
    gradient steps per transition, seeds 0 and 1). With 3,000 env steps (``learning_starts``
    500) RLPD reached 0.88, 0.79, 0.62 on seeds 0-2, about 50 s a run. The thread learner in virtual time and the learner
    process give the same numbers. The test runs seed 0 and asks RLPD for ``MARGIN`` more than
    SAC."""
    sac, sac_algo = train("sac", learner)
    rlpd, rlpd_algo = train("rlpd", learner)
    print(f"sparse ring reach ({learner}), {STEPS} env steps: success SAC {sac:.2f} ({sac_algo.grad_steps} gradient "
          f"steps, alpha {sac_algo.alpha:.3f}), RLPD {rlpd:.2f} ({rlpd_algo.grad_steps}, alpha {rlpd_algo.alpha:.3f}, "
          f"{len(rlpd_algo.demos)} demonstrated transitions)")
    assert rlpd >= sac + MARGIN, (rlpd, sac)
