"""Data-parallel jobs (ebrl.distributed): two gloo ranks on the CPU, each a full runtime.

Short runs on MockEnv: identical weights on every rank after every update (hashed), counters
summed exactly, unequal sample counts weighted by rows, a killed rank ending the job, resume
across ranks, plain torchrun, a script under torchrun, and the Ray launcher on a local Ray."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from ebrl.config import ConfigError, RunConfig
from ebrl.distributed import DataParallel, rank_config, rank_seed, rank_share, weight_hash

MOCK = ["--set", "env=mock/3", "--set", "run.num_envs=4", "--set", "run.segment_len=16",
        "--set", "env_kwargs.episode_len=8"]


def ebrl_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "ebrl", *args]


def train(tmp: Path, *extra: str, nproc: int = 2, total: int = 4000, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(ebrl_cmd("train", "--nproc", str(nproc), "--quiet", "--log-dir", str(tmp), *MOCK,
                                   "--set", f"run.total_env_steps={total}", *extra),
                          capture_output=True, text=True, timeout=timeout)


def result(tmp: Path) -> dict:
    return json.loads((tmp / "result.json").read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_keep_identical_weights_and_sum_their_counters(tmp_path):
    out = train(tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    r = result(tmp_path)
    assert r["world_size"] == 2 and len(r["rank_weight_hashes"]) == 2
    assert r["rank_weight_hashes"][0] == r["rank_weight_hashes"][1]
    # every update after the first started with the weights checked equal on both ranks
    assert r["weight_checks"] == r["updates"] - 1 and r["updates"] > 5
    assert [x["env_steps"] for x in r["ranks"]] == [2000, 2000]  # the job's budget, split
    assert r["env_steps"] == 4000 == sum(x["env_steps"] for x in r["ranks"])
    assert r["trained"] == sum(x["trained"] for x in r["ranks"])
    assert r["env_steps"] == r["trained"] + sum(r["dropped"].values()) + r["in_flight_at_stop"]
    assert len(r["steps_per_env"]) == 8 and sum(r["steps_per_env"]) == 4000
    assert (tmp_path / "events-rank1.jsonl").exists() and (tmp_path / "checkpoint.pt").exists()
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert ckpt["meta"]["env_steps"] == 4000 and ckpt["meta"]["world_size"] == 2


def test_grpo_under_sync_trains_whole_episodes_on_every_rank(tmp_path):
    # sync: a round waits for every rank, and a joint take never cuts a segment the lag bound
    # does not, so each rank brings whole episodes in whole groups
    out = train(tmp_path, "--set", "algo.kind=grpo", "--set", "run.segment_len=8", total=3200)
    assert out.returncode == 0, out.stderr[-3000:]
    r = result(tmp_path)
    assert r["schedule"] == "sync" and r["rank_weight_hashes"][0] == r["rank_weight_hashes"][1]
    assert r["env_steps"] == r["trained"] + sum(r["dropped"].values()) + r["in_flight_at_stop"]
    rows = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert rows and all(row["segments_unused"] == 0 for row in rows)
    assert sum(row["segments_used"] for row in rows) == 1600 / 8  # rank 0's every episode


def test_resume_continues_the_job_across_ranks(tmp_path):
    # two jobs of four processes each: small ones (a rank's start costs seconds, its steps little)
    first, second = tmp_path / "a", tmp_path / "b"
    assert train(first, total=512).returncode == 0
    out = train(second, "--resume", str(first / "checkpoint.pt"), total=1024)
    assert out.returncode == 0, out.stderr[-3000:]
    r = result(second)
    assert r["env_steps"] == 512 and [x["env_steps"] for x in r["ranks"]] == [256, 256]
    assert r["rank_weight_hashes"][0] == r["rank_weight_hashes"][1]
    assert torch.load(second / "checkpoint.pt", weights_only=True)["meta"]["env_steps"] == 1024


def process_tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = subprocess.run(["pgrep", "-P", str(p)], capture_output=True, text=True).stdout.split()
        out += [int(k) for k in kids]
        todo += [int(k) for k in kids]
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def rank_pids(launcher: int) -> dict[int, int]:
    ranks = {}
    for p in process_tree(launcher):
        try:
            env = Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        rank = [e for e in env if e.startswith(b"RANK=")]
        if rank and any(e.startswith(b"EBRL_LAUNCHER_PID=") for e in env) and int(open(f"/proc/{p}/stat").read().split()[3]) == launcher:
            ranks[int(rank[0].split(b"=")[1])] = p
    return ranks


def test_a_killed_rank_ends_the_job_with_one_error_and_nothing_left(tmp_path):
    proc = subprocess.Popen(ebrl_cmd("train", "--nproc", "2", "--quiet", "--log-dir", str(tmp_path), *MOCK,
                                     "--set", "run.total_env_steps=1000000000",
                                     "--set", 'run.sim={backend="process", num_workers=1}'),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (tmp_path / "history.jsonl").exists():
            time.sleep(0.2)  # the job trains
        ranks = rank_pids(proc.pid)
        assert sorted(ranks) == [0, 1]
        everything = process_tree(proc.pid)  # ranks, their sim workers, the resource tracker
        os.kill(ranks[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=60)  # the job ends (past 60 s: TimeoutExpired fails the test)
        assert proc.returncode != 0
        lines = [ln for ln in err.splitlines() if ln.startswith("ebrl: rank 1 of 2 failed")]
        assert lines and "killed by SIGKILL" in lines[0], err[-3000:]
        assert "Traceback" not in err  # rank 0 reports the lost collective in one line
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(alive(p) for p in everything):
            time.sleep(0.1)
        assert [p for p in everything if alive(p)] == []
    finally:
        if proc.poll() is None:
            proc.kill()


SCRIPT = textwrap.dedent('''
    import json, os, sys, time
    import ebrl
    from ebrl.algos import PPO
    from ebrl.policies import MLPPolicy
    from ebrl.testing import Latency, MockEnv

    rank = int(os.environ["RANK"])
    trained = os.path.join(sys.argv[1], "trained")  # written once the job's first update is done

    class Trains(PPO):
        def update(self, policy, batch):
            metrics = super().update(policy, batch)
            open(trained, "a").close()
            return metrics

    class Held(MockEnv):
        """Rank 1's envs are slow (4 ms a step), and after their first step (the one a rank
        needs to join updates) they wait for the job's first update: counted, not timed, rank
        1 has no segment for that update on any machine, however busy, so its first update
        weighs rank 0's rows alone instead of waiting for rank 1's."""

        def step(self, action):
            if rank == 1 and self.steps >= 1 and not os.path.exists(trained):
                deadline = time.monotonic() + 60
                while not os.path.exists(trained):
                    if time.monotonic() > deadline:
                        raise RuntimeError("the job's first update never came: it waited for rank 1's steps")
                    time.sleep(0.002)
            return super().step(action)

    latency = Latency.constant(0.004 if rank == 1 else 0.0)
    env = MockEnv(dim=3)
    policy = MLPPolicy.from_spaces(env.observation_space, env.action_space, seed=rank)  # rank 0's win
    cfg = ebrl.RunConfig(num_envs=4, segment_len=16, total_env_steps=3000, learner="thread",
                         sim={"backend": "thread", "num_threads": 4})
    res = ebrl.run_sync(ebrl.Trainer(lambda i: Held(dim=3, latency=latency), policy, Trains(minibatch_size=32), cfg))
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump({"hashes": res.rank_weight_hashes, "ranks": res.ranks, "updates": res.updates,
                   "checks": res.weight_checks, "num_steps": [h["num_steps"] for h in res.history],
                   "ok": res.accounting_ok(), "env_steps": res.env_steps, "env_failures": res.env_failures}, f)
''')


def test_a_script_under_torchrun_weights_unequal_ranks_by_their_rows(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    torchrun = Path(sys.executable).with_name("torchrun")
    out = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", str(script), str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["hashes"] == r1["hashes"] and r0["hashes"][0] == r0["hashes"][1]
    assert r0["updates"] == r1["updates"] and r0["checks"] == r0["updates"] - 1
    assert r0["ok"] and r0["env_steps"] == 3000
    assert r0["env_failures"] == r1["env_failures"] == 0  # no wait of rank 1's envs ran out
    # the ranks joined every update with what each had (neither waited for the other's steps),
    # and each trained its whole share: the first update, with rank 1's envs held, had rank 0's
    # rows and none of rank 1's
    assert len(r0["num_steps"]) == len(r1["num_steps"])
    assert sum(r0["num_steps"]) == 1500 == sum(r1["num_steps"])
    assert r0["num_steps"][0] > 0 and r1["num_steps"][0] == 0


def test_plain_torchrun_runs_ebrl_train_in_one_log_dir(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    out = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "ebrl", "train", "--quiet",
                          *MOCK, "--set", "run.total_env_steps=2000"], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    dirs = list((tmp_path / "runs").iterdir())
    assert len(dirs) == 1  # rank 0 named it, rank 1 used it
    r = json.loads((dirs[0] / "result.json").read_text())
    assert r["world_size"] == 2 and r["env_steps"] == 2000 and (dirs[0] / "events-rank1.jsonl").exists()


WORKER = textwrap.dedent('''
    import json, math, os, sys
    import torch
    from ebrl.distributed import DataParallel, RanksDivergedError

    dp = DataParallel.from_env()
    rank = dp.rank
    lin = torch.nn.Linear(1, 1, bias=False)
    out = {}
    # rows-weighted mean: rank 0 brings 1 row with gradient 1, rank 1 three rows with gradient 5
    lin.weight.grad = torch.tensor([[1.0 if rank == 0 else 5.0]])
    out["ok"] = dp.reduce_grads([lin.weight], 1 if rank == 0 else 3, True)
    out["grad"] = float(lin.weight.grad)
    # a rank with no rows: the other's gradient alone
    lin.weight.grad = torch.tensor([[7.0]]) if rank == 0 else None
    dp.reduce_grads([lin.weight], 2 if rank == 0 else 0, True)
    out["grad_one_side"] = float(lin.weight.grad)
    # a NaN loss on one rank: no step on either
    lin.weight.grad = torch.tensor([[1.0]])
    out["nonfinite"] = dp.reduce_grads([lin.weight], 1, rank == 0)
    out["steps"] = dp.agree_steps(10 if rank == 0 else 100, 32)
    rows = dp.header([float(rank + 1)], None)
    out["header"] = rows
    with torch.no_grad():
        lin.weight.fill_(float(rank))  # the ranks' weights now differ
    try:
        dp.header([0.0], lin.state_dict())
        out["diverged"] = False
    except RanksDivergedError:
        out["diverged"] = True
    dp.close()
    json.dump(out, open(sys.argv[1] + f"/w{rank}.json", "w"))
''')


def test_collectives_weight_gradients_by_rows_and_catch_divergence(tmp_path):
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path)],
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port)}, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err[-3000:]
    w0, w1 = (json.loads((tmp_path / f"w{r}.json").read_text()) for r in (0, 1))
    for w in (w0, w1):
        assert w["ok"] and w["grad"] == pytest.approx((1 * 1 + 3 * 5) / 4)
        assert w["grad_one_side"] == pytest.approx(7.0)
        assert w["nonfinite"] is False
        assert w["steps"] == 4  # ceil(100 / 32): the most any rank needs
        assert w["header"] == [[1.0], [2.0]]
        assert w["diverged"] is True


def test_rank_config_splits_the_budget_and_refuses_a_learner_process():
    class FakeDP:
        rank, world_size = 1, 3

    cfg = rank_config(RunConfig(total_env_steps=10, seed=5, log_dir="runs/x", checkpoint_every_s=60.0), FakeDP())
    assert cfg.total_env_steps == 3 == rank_share(10, 1, 3) and cfg.seed == rank_seed(5, 1) != 5
    assert 0 <= cfg.seed < 2**31
    assert cfg.log_dir is None and cfg.checkpoint_every_s is None and cfg.learner == "thread"
    with pytest.raises(ConfigError, match="learner"):
        rank_config(RunConfig(learner="process"), FakeDP())
    with pytest.raises(ConfigError, match="total_env_steps"):
        rank_config(RunConfig(total_env_steps=2), FakeDP())
    with pytest.raises(ConfigError, match="collective_timeout_s"):
        rank_config(RunConfig(faults={"collective_timeout_s": 30.0}), FakeDP())
    assert DataParallel.from_env({"WORLD_SIZE": "1"}) is None
    assert DataParallel.from_env({"WORLD_SIZE": "2", "EBRL_DATA_PARALLEL": "0"}) is None  # the opt-out


def test_weight_hash_changes_with_any_weight():
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    b.load_state_dict(a.state_dict())
    assert weight_hash(a) == weight_hash(b)
    with torch.no_grad():
        b.bias[0] += 1e-6
    assert weight_hash(a) != weight_hash(b)


def test_the_ray_launcher_runs_two_ranks_on_a_local_ray(tmp_path):
    """Ray's start and the ranks' imports cost what they cost (tens of seconds on a busy 2-core
    machine), so the rest is kept small. The launcher's module is loaded alone, by its path, and
    its actor class goes to Ray by value: ``import ebrl.launch`` would import the package (torch:
    seconds of CPU) in the launching process and again in each actor, which only start a rank.
    The ranks run ``python -m ebrl train`` as always, on a small job (128 steps a rank: two
    updates' worth) whose envs step inline (no probe child, no lane threads)."""
    pytest.importorskip("ray")
    launch = Path(__file__).resolve().parent.parent / "ebrl" / "launch.py"
    code = textwrap.dedent(f'''
        import importlib.util, sys
        import ray.cloudpickle
        spec = importlib.util.spec_from_file_location("ebrl_launch_alone", {str(launch)!r})
        launch = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = launch
        spec.loader.exec_module(launch)
        ray.cloudpickle.register_pickle_by_value(launch)  # the actors need not import it, nor ebrl
        assert "torch" not in sys.modules
        sys.exit(launch.launch_ray(None, 2, ["train", "--quiet", "--log-dir", {str(tmp_path)!r}, *{MOCK!r},
                                             "--set", "run.total_env_steps=256", "--set", 'run.sim={{backend="inline"}}'],
                                   ray_init={{"num_cpus": 2}}))
    ''')
    # Ray starts its workers at nice 15 (RAY_worker_niceness), and a rank is a child of one: beside
    # a busy machine's processes at nice 0 the ranks got a few percent of a core, and the job took
    # minutes. Here they run at the priority the rest of the test suite runs at.
    env = {**os.environ, "RAY_worker_niceness": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    # under the test's own timeout (pytest's 120 s), so that a slow start fails this test, not its xdist worker
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=110, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    r = result(tmp_path)
    assert r["world_size"] == 2 and r["env_steps"] == 256 and [x["env_steps"] for x in r["ranks"]] == [128, 128]
    assert r["updates"] >= 2 and r["weight_checks"] == r["updates"] - 1  # both ranks joined each update
    assert r["rank_weight_hashes"][0] == r["rank_weight_hashes"][1]
