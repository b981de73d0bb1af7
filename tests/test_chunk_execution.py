"""A policy acting in chunks runs on per-step envs with no wrapper: ``ebrl.run`` and
``evaluate`` execute its K actions per decision themselves (ebrl.envs.chunks.for_policy)."""

import gymnasium as gym
import numpy as np
import pytest

import ebrl
from ebrl.algos import PPO
from ebrl.envs.chunks import ActionChunk, ChunkedEnvFn, chunked_env_fn, for_policy
from ebrl.evaluation import evaluate
from ebrl.policies import FlowPolicy, MLPPolicy
from ebrl.testing import MockEnv, run_virtual

K, A, EPISODE = 3, 2, 10


class CountingEnv(MockEnv):
    """MockEnv that counts the single actions it receives (each one is one ``step``)."""

    steps = 0

    def step(self, action):
        assert np.shape(action) == (A,), np.shape(action)
        CountingEnv.steps += 1
        return super().step(action)


def flow(seed=0):
    env = MockEnv(dim=A)
    return FlowPolicy.from_spaces(env.observation_space, gym.spaces.Box(-1, 1, (K, A)), hidden=(8,), seed=seed)


def test_run_executes_chunks_on_a_per_step_env():
    CountingEnv.steps = 0
    trainer = ebrl.Trainer(env_fn=lambda i: CountingEnv(dim=A, episode_len=EPISODE), policy=flow(), algo=PPO(),
                           config=ebrl.RunConfig(num_envs=2, segment_len=4, total_env_steps=64,
                                                 sim={"backend": "thread"}))  # no probe steps in the count
    result = run_virtual(trainer)
    assert result.env_steps == 64 and result.accounting_ok()  # decisions, one chunk each
    # every decision ran up to K single steps; an episode of 10 is 4 decisions (3 + 3 + 3 + 1)
    assert 64 * (EPISODE / 4) <= CountingEnv.steps <= 64 * K
    assert trainer.env_fn.__class__.__name__ == "function"  # the user's trainer is left as it was


def test_evaluate_executes_chunks():
    CountingEnv.steps = 0
    r = evaluate(flow(), CountingEnv(dim=A, episode_len=EPISODE), episodes=2)
    assert r.mean_length == 4 and CountingEnv.steps == 2 * EPISODE


def test_wraps_only_where_the_shapes_say_so():
    policy = flow()
    assert isinstance(for_policy(MockEnv(dim=A), policy), ActionChunk)
    already = ActionChunk(MockEnv(dim=A), K)
    assert for_policy(already, policy) is already  # a user's own wrapper stays the only one
    other = MockEnv(dim=A + 1)
    assert for_policy(other, policy) is other  # a mismatch is left to the space check to name
    mlp = MLPPolicy.from_spaces(MockEnv(dim=A).observation_space, gym.spaces.Box(-1, 1, (A,)), hidden=(8,))
    fn = lambda i: MockEnv(dim=A)  # noqa: E731
    assert chunked_env_fn(fn, mlp) is fn
    assert isinstance(chunked_env_fn(fn, policy), ChunkedEnvFn)


def test_a_mismatch_is_still_one_error():
    trainer = ebrl.Trainer(env_fn=lambda i: MockEnv(dim=A + 1), policy=flow(), algo=PPO(),
                           config=ebrl.RunConfig(num_envs=2, segment_len=4, total_env_steps=64))
    with pytest.raises(ebrl.ConfigError, match=r"acts in a Box of shape \(3, 2\)"):
        run_virtual(trainer)


def test_process_backend_pickles_the_chunked_env_fn(tmp_path, monkeypatch):
    import os

    pickled = []  # the pid pickling the user's env_fn, each time it is pickled

    class EnvFn:
        """The user's env_fn: a local class (pickled by value, as a lambda is). Each env it builds
        leaves a file naming the process it was built in and, once closed, its single steps."""

        def __init__(self, where):
            self.where = where

        def __call__(self, i):
            env, steps = CountingEnv(dim=A, episode_len=EPISODE), [0]
            built, step, close = self.where / f"env{i}-pid{os.getpid()}", env.step, env.close
            built.write_text("")
            env.step = lambda action: (steps.__setitem__(0, steps[0] + 1), step(action))[1]
            env.close = lambda: (built.write_text(str(steps[0])), close())
            return env

        def __reduce__(self):
            pickled.append(os.getpid())
            return EnvFn, (self.where,)

    # as where a renderer's driver is loaded: the workers start from a fork server, so the env_fn
    # reaches them only pickled (a fork would copy it in memory)
    monkeypatch.setattr("ebrl.runtime.children.fork_hazard", lambda: "libEGL (as if loaded)")
    trainer = ebrl.Trainer(env_fn=EnvFn(tmp_path), policy=flow(), algo=PPO(),
                           config=ebrl.RunConfig(num_envs=2, segment_len=4, total_env_steps=32,
                                                 sim={"backend": "process", "num_workers": 1}))
    result = ebrl.run_sync(trainer)
    assert result.env_steps == 32 and result.accounting_ok()
    assert pickled and set(pickled) == {os.getpid()}  # pickled here, to be sent
    built: dict[str, list] = {}  # pid: the files of the envs built there (the start-up probe builds env 0 too)
    for path in tmp_path.iterdir():
        built.setdefault(path.name.split("-pid")[1], []).append(path)
    worker = [files for pid, files in built.items() if pid != str(os.getpid()) and len(files) == 2]
    assert len(worker) == 1 and sorted(p.name.split("-pid")[0] for p in worker[0]) == ["env0", "env1"], built
    # the one worker built both envs from the copy it unpickled, and there each decision ran up to
    # K single steps: the chunk wrapper came along inside the env_fn
    steps = sum(int(p.read_text()) for p in worker[0])
    assert 32 < steps <= 32 * K + 2 * K, steps
