"""Nothing that starts children outlives its owner: the fork server and the resource tracker that
a run, a pool, a probe or a learner process started are stopped when it ends, in a fresh
interpreter where nothing else holds them (this session's own scope would, see conftest.py)."""

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork servers and /proc")

# each owner in turn, on the fork server; after each: are the helpers running, and which
# processes are left below this one
SCRIPT = textwrap.dedent("""\
    import asyncio, json, os, sys
    from pathlib import Path

    import torch

    import ebrl
    from ebrl.config import FaultConfig, SimConfig
    from ebrl.runtime import children
    from ebrl.runtime.learner_process import LearnerProcess
    from ebrl.runtime.probe import EnvProbe
    from ebrl.runtime.sim import SimPool
    from ebrl.testing import MockEnv, MockPolicy, NoopAlgo

    def left():
        kids = []
        for tasks in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
            kids += [int(k) for k in tasks.read_text().split()]
        live = [k for k in kids if Path(f"/proc/{k}/stat").exists()
                and Path(f"/proc/{k}/stat").read_text().rpartition(")")[2].split()[0] not in "ZX"]
        return {"helpers": children._helpers_running(), "children": live, "server_seen": seen[-1]}

    seen = [False]
    real = children._helpers_running
    def spy():  # whether the fork server ran at some point of the owner's life
        running = real()
        seen[-1] = seen[-1] or running[0]
        return running

    env_fn = lambda i: MockEnv(dim=2, episode_len=5)
    sim = SimConfig(backend="process", num_workers=1, start_method="forkserver")

    async def pool():
        p = SimPool(env_fn, 2, sim)
        await p.start()
        await p.reset(0, seed=0)
        spy()
        p.close()

    async def probe():
        async with EnvProbe(env_fn, SimConfig(backend="auto", start_method="forkserver"), FaultConfig()) as p:
            await p.facts()
            spy()

    def learner():
        policy = torch.nn.Linear(2, 2)
        remote = LearnerProcess(policy, NoopAlgo(), torch_threads=1, start_method="forkserver", start_timeout_s=60)
        remote.algo_state()  # started and answering
        spy()
        remote.close(policy, NoopAlgo())

    def run():
        trainer = ebrl.Trainer(env_fn=env_fn, policy=MockPolicy(act_dim=2), algo=NoopAlgo(),
                               config=ebrl.RunConfig(num_envs=2, segment_len=4, total_env_steps=16,
                                                     sim={"backend": "process", "num_workers": 1,
                                                          "start_method": "forkserver"}))
        ebrl.run_sync(trainer)
        seen[-1] = True  # run() stops its helpers before it returns: checked below by their absence

    out = {}
    for name, owner in [("pool", pool), ("probe", probe), ("learner", learner), ("run", run)]:
        seen.append(False)
        result = owner()
        if asyncio.iscoroutine(result):
            asyncio.run(result)
        out[name] = left()
    print("RESULT", json.dumps(out))
""")


@pytest.fixture(scope="module")
def after_each_owner():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("RESULT", 1)[1])


@pytest.mark.parametrize("owner", ["pool", "probe", "learner", "run"])
def test_an_owner_of_children_stops_the_helpers_it_started(after_each_owner, owner):
    state = after_each_owner[owner]
    if owner != "run":
        assert state["server_seen"], "the owner never used a fork server: the test proves nothing"
    assert state["helpers"] == [False, False], "fork server, resource tracker still running"
    assert state["children"] == []


def test_nested_scopes_stop_the_helpers_with_the_last():
    script = textwrap.dedent("""\
        from ebrl.runtime import children
        with children.helpers_scope():
            with children.helpers_scope():
                p = children.fork_server().Process(target=int)
                p.start(); p.join(30)
            inner = children._helpers_running()[0]
        print(inner, children._helpers_running()[0])
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split() == ["True", "False"]
