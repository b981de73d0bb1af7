"""DSRL (ebrl/policies/dsrl.py): SAC steering the initial noise of a frozen flow policy. It
improves a cloned FlowPolicy's return on a chunked reach in virtual time with the flow's weights bit
for bit as they were, and runs from the command line's config on a tiny π0 (transformers' and
LeRobot's layouts) and a tiny SmolVLA, publishing only the steering actor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ebrl
from ebrl.algos import SAC
from ebrl.envs.chunks import ActionChunk
from ebrl.policies import FlowPolicy
from ebrl.policies.dsrl import DSRLPolicy
from ebrl.testing import RingReach, run_episodes, run_virtual, torch_threads

K = 4
EVAL_SEEDS = range(20_000, 20_048)


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def chunked() -> ActionChunk:
    return ActionChunk(RingReach(), K)


def mean_return(policy) -> float:
    """The mode's mean return on fixed reset seeds."""
    return float(run_episodes(policy, [chunked() for _ in EVAL_SEEDS], EVAL_SEEDS)[0].mean())


def test_the_chunk_is_a_deterministic_function_of_the_noise_and_only_the_actor_is_published():
    probe = chunked()
    flow = FlowPolicy.from_spaces(probe.observation_space, probe.action_space, seed=0)
    policy = DSRLPolicy(flow, noise_bound=1.5, hidden=(32, 32))
    obs = np.stack([probe.reset(seed=s)[0] for s in range(6)])
    out = policy.act(obs)
    assert out.actions.shape == (6, K * 2) and np.abs(out.actions).max() <= 1.5
    again = flow.act(obs, noise=policy.noise(out.actions))
    np.testing.assert_array_equal(again.env_actions, out.env_actions)
    assert flow.method == "ode" and not flow.training and not any(p.requires_grad for p in flow.parameters())
    assert set(policy.trainable_state_dict()) == {f"steer.{k}" for k in policy.steer.state_dict()}
    with pytest.raises(ValueError, match="steers a flow policy"):
        DSRLPolicy(torch.nn.Linear(2, 2))



def test_dsrl_on_the_process_learner_trains_as_the_thread_learner_and_hands_back_the_actor():
    """The algorithm in the learner process (sync, inline sims: the same batches whatever the
    load), 96 decisions over 4 envs, the policy and SAC sent there forked and pickled (a fork
    server's child, as where a renderer is loaded): the flow policy's weights bit for bit as they
    were, each publication and the hand-back at the end the actor alone, and the actor and SAC's
    state (critics, optimisers, RNG) bit for bit as the same run on the thread learner leaves them."""
    from ebrl.runtime.learner_process import _Learner

    def run(learner: str, start_method: str | None = None):
        probe = chunked()
        flow = FlowPolicy.from_spaces(probe.observation_space, probe.action_space, seed=0)
        policy = DSRLPolicy(flow, noise_bound=1.5, hidden=(32, 32))
        sac = SAC(batch_size=32, learning_starts=32, critic_hidden=(32, 32), init_alpha=0.1)
        cfg = ebrl.RunConfig(num_envs=4, segment_len=4, total_env_steps=96, seed=0, schedule="sync",
                             learner=learner, sim={"backend": "inline", "start_method": start_method})
        trainer = ebrl.Trainer(lambda i: chunked(), policy, sac, cfg)
        return policy, sac, (ebrl.run_sync(trainer) if learner == "process" else run_virtual(trainer))

    thread_policy, thread_sac, thread_res = run("thread")
    assert thread_res.learner_mode == "thread" and thread_sac.grad_steps == 80
    probe = chunked()
    untrained = DSRLPolicy(FlowPolicy.from_spaces(probe.observation_space, probe.action_space, seed=0),
                           noise_bound=1.5, hidden=(32, 32))
    actor_bytes = sum(v.numel() * v.element_size() for v in untrained.steer.state_dict().values())
    for start_method in ("fork", "forkserver"):
        policy, sac, res = run("process", start_method)
        assert res.learner_mode == "process" and res.accounting_ok() and res.env_steps == res.trained == 96
        assert all(torch.equal(v, untrained.base.state_dict()[k]) for k, v in policy.base.state_dict().items())
        assert any(not torch.equal(v, untrained.steer.state_dict()[k]) for k, v in policy.steer.state_dict().items())
        assert res.publish_bytes == actor_bytes
        assert all(torch.equal(v, thread_policy.state_dict()[k]) for k, v in policy.state_dict().items()), start_method
        assert_same(sac.state_dict(), thread_sac.state_dict())
    assert set(_Learner(policy, sac, None).final()[0]) == set(policy.trainable_state_dict())  # not the flow's


def assert_same(a, b, path: str = "") -> None:
    """Two nested states (dicts, lists, tensors, numbers) equal bit for bit."""
    assert type(a) is type(b), path
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b, path


def pretrained_flow(noise_std: float = 0.3, steps: int = 300) -> FlowPolicy:
    """A FlowPolicy (K=4) cloned by flow matching from the scripted expert's chunks with Gaussian
    noise of ``noise_std`` added (the bounds are +-0.5): close to the expert, not at it."""
    from tests.test_learning_reach import expert_actions

    probe = chunked()
    flow = FlowPolicy.from_spaces(probe.observation_space, probe.action_space, seed=0)
    expert, rng, gen = expert_actions("ring-2d", K), np.random.default_rng(0), torch.Generator().manual_seed(0)
    opt = torch.optim.Adam([p for p in flow.parameters() if p.requires_grad], lr=1e-3)
    for _ in range(steps):
        pos, target = rng.uniform(-1, 1, (256, 2)), probe.unwrapped.targets[rng.integers(6, size=256)]
        obs = np.concatenate([pos, target], 1).astype(np.float32)
        chunks = np.clip(expert(obs) + rng.normal(0, noise_std, (256, K, 2)), -0.5, 0.5).astype(np.float32)
        loss = flow.flow_matching_loss(torch.as_tensor(obs), torch.as_tensor(chunks), gen)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return flow


@pytest.mark.slow  # about 50 s on a loaded core (the process learner's run: 20 to 110 s): make test-slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("learner", ["virtual", "process"])
def test_dsrl_improves_a_frozen_flow_policy_and_leaves_its_weights_bit_identical(learner):
    """A FlowPolicy (K=4) cloned from noisy demonstrations, frozen; SAC in its noise space, 4 envs
    in segments of 4 decisions, 1,000 decisions: the mode's return closes most of the gap from the
    clone's to the expert's (measured: -7.01 -> -2.55, the expert's -2.12: 0.91 of it; the bar
    0.5), about 25 s on one core after 10 s of cloning, in virtual time on the thread learner. In
    a real run with SAC in the learner process (sync, inline sims: the same batches whatever the
    load) the same numbers, its run 20 to 110 s on a machine of 2 cores (measured; in the slow
    runs one policy call in ten took 0.2 s, in the fast ones 3 ms at most)."""
    from tests.test_learning_reach import episode_returns, expert_actions

    flow = pretrained_flow()
    policy = DSRLPolicy(flow, noise_bound=1.5, hidden=(64, 64))
    frozen = {k: v.clone() for k, v in flow.state_dict().items()}
    before = mean_return(policy)
    expert = float(episode_returns("ring-2d", 1, expert_actions("ring-2d", 1)).mean())
    sac = SAC(batch_size=128, learning_starts=200, critic_hidden=(64, 64), init_alpha=0.1)
    if learner == "virtual":
        cfg = ebrl.RunConfig(num_envs=4, segment_len=4, total_env_steps=1000 * K, seed=0)
        res = run_virtual(ebrl.Trainer(lambda i: chunked(), policy, sac, cfg))
    else:
        cfg = ebrl.RunConfig(num_envs=4, segment_len=4, total_env_steps=1000 * K, seed=0, schedule="sync",
                             learner="process", sim={"backend": "inline"})
        res = ebrl.run_sync(ebrl.Trainer(lambda i: chunked(), policy, sac, cfg))
        assert res.learner_mode == "process" and sac.state_dict()["critic"] is not None  # handed back
    after = mean_return(policy)
    closed = (after - before) / (expert - before)
    print(f"DSRL ({learner}) on a frozen FlowPolicy, ring-2d K={K}: return {before:.2f} -> {after:.2f} "
          f"(expert {expert:.2f}, closed {closed:.2f}), {sac.grad_steps} gradient steps, "
          f"publication {res.publish_bytes:.0f} bytes")
    assert res.accounting_ok()
    assert all(torch.equal(flow.state_dict()[k], v) for k, v in frozen.items())
    assert closed > 0.5


@pytest.mark.usefixtures("hf_offline")
@pytest.mark.parametrize(("kind", "learner"), [
    pytest.param("pi0", "virtual", id="pi0"), pytest.param("pi0-lerobot", "virtual", id="pi0-lerobot"),
    pytest.param("smolvla", "virtual", id="smolvla"), pytest.param("smolvla", "process", id="smolvla-process")])
def test_dsrl_from_the_config_on_a_tiny_vla_trains_only_the_steering_actor(kind, learner, tmp_path):
    """``policy.method=dsrl`` with ``algo=sac`` on mock/reach: the VLA's weights unchanged, the
    actor's moved, and what each update published is the actor alone; in virtual time, and in a
    real run with SAC in the learner process, the VLA and SAC pickled to a fork server's child."""
    from ebrl.runs import build_spec, build_trainer
    from ebrl.testing import InstructedReach, save_random_pi0
    from ebrl.testing_smolvla import save_random_smolvla

    path = tmp_path / "policy"
    sentences = tuple(InstructedReach().instructions())
    extra = []
    if kind == "smolvla":
        save_random_smolvla(path, tmp_path / "vlm", camera_names=(), state_dim=4, action_dim=2)
        extra = [f"policy.vlm={tmp_path / 'vlm'}"]
    elif kind == "pi0-lerobot":
        save_random_pi0(path, kind="pi0", layout="lerobot", tokenizer_dir=tmp_path / "tok", state_dim=4,
                        action_dim=2, chunk_size=4, camera_names=[], sentences=sentences)
        extra = [f"policy.tokenizer={tmp_path / 'tok'}"]
    else:
        save_random_pi0(path, kind="pi0", state_dim=4, action_dim=2, chunk_size=4, camera_names=[], sentences=sentences)
    spec = build_spec(None, ["env=mock/reach", "policy.kind=hf", f"policy.path={path}", 'policy.method="dsrl"',
                             "policy.execute=2", "policy.steer_hidden=[16]", "algo=sac", "sac.batch_size=16",
                             "sac.learning_starts=16", "sac.critic_hidden=[16]", "run.num_envs=2",
                             "run.segment_len=4", "run.total_env_steps=64", *extra,
                             *(['run.learner="process"', 'run.schedule="sync"', 'run.sim.backend="inline"',
                                'run.sim.start_method="forkserver"'] if learner == "process" else [])])
    trainer = build_trainer(spec)
    policy = trainer.policy
    assert isinstance(policy, DSRLPolicy) and policy.act_dim == 2 * 2
    base = {k: v.clone() for k, v in policy.base.state_dict().items()}
    steer = {k: v.clone() for k, v in policy.steer.state_dict().items()}
    res = run_virtual(trainer) if learner == "virtual" else ebrl.run_sync(trainer)
    assert res.accounting_ok() and trainer.algo.grad_steps > 0
    assert res.learner_mode == ("process" if learner == "process" else "thread")
    assert all(torch.equal(policy.base.state_dict()[k], v) for k, v in base.items())
    assert any(not torch.equal(policy.steer.state_dict()[k], v) for k, v in steer.items())
    actor_bytes = sum(v.numel() * v.element_size() for v in policy.steer.state_dict().values())
    assert res.publish_bytes == actor_bytes
