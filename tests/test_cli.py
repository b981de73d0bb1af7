import json

import numpy as np
import pytest
import torch

from ebrl.cli import main
from ebrl.runs import build_spec
from ebrl.config import ConfigError


def test_spec_overrides_and_files(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('env = "mock/3"\n[run]\nnum_envs = 4\n[ppo]\nlr = 0.001\n')
    spec = build_spec(str(cfg), ["run.total_env_steps=500", "policy.hidden=[16, 16]"])
    assert spec["env"] == "mock/3" and spec["ppo"]["lr"] == 0.001 and spec["policy"]["hidden"] == [16, 16]
    assert spec["run"]["num_envs"] == 4 and spec["run"]["total_env_steps"] == 500
    assert spec["run"]["segment_len"] == 32  # tables merge over the demo's
    with pytest.raises(ConfigError, match="unknown key"):
        build_spec(None, ["algorithm.lr=1"])


def test_algo_and_policy_kinds_each_with_its_own_table():
    from ebrl.algos import GRPO, DecoupledPPO, VTrace
    from ebrl.runs import build_algo, build_trainer
    from ebrl.policies import FlowPolicy, TokenPolicy

    base = ["env=mock/3", "run.num_envs=8", "env_kwargs.episode_len=8"]
    algo = build_algo(build_spec(None, ["algo.kind=vtrace", "vtrace.rho_bar=2.0"]))
    assert isinstance(algo, VTrace) and algo.config.rho_bar == 2.0
    assert isinstance(build_algo(build_spec(None, ["algo.kind=dppo"])), DecoupledPPO)
    trainer = build_trainer(build_spec(None, [*base, "algo.kind=grpo", "policy.kind=token", "policy.d_model=32"]))
    assert isinstance(trainer.algo, GRPO) and isinstance(trainer.policy, TokenPolicy)
    # what GRPO needs (GRPO.run_needs), resolved by build_trainer as ebrl.run resolves it
    assert trainer.config.segment_cut == "episode" and trainer.config.reset_group == 4
    assert trainer.config.schedule == "sync"
    mine = build_trainer(build_spec(None, [*base, "algo.kind=grpo", 'run.schedule="async"']))
    assert mine.config.schedule == "async"  # what the run sets wins
    # GRPO's segments hold whole episodes: at least the env's time limit (FetchReach: 50 steps)
    fetch = build_trainer(build_spec(None, ["env=robotics/FetchReach-v4", "algo.kind=grpo", "run.num_envs=8"]))
    assert fetch.config.segment_len == 50 and build_spec(None, [])["run"]["segment_len"] == 32
    flow = build_trainer(build_spec(None, [*base, "policy.kind=flow", "env_kwargs.chunk=4"]))
    assert isinstance(flow.policy, FlowPolicy) and flow.policy.chunk_shape == (4, 3)
    with pytest.raises(ConfigError, match="algo.kind"):
        build_algo(build_spec(None, ["algo.kind=ddpg"]))  # no such kind (sac is one now)
    with pytest.raises(ConfigError, match="algo.lr"):
        build_algo(build_spec(None, ["algo.lr=1"]))
    with pytest.raises(ConfigError, match="rho_bar"):
        build_algo(build_spec(None, ["algo.kind=vtrace", "vtrace.rho_bar=-1"]))


def test_train_runs_end_to_end_and_writes_results(tmp_path, capsys):
    code = main(["train", "--quiet", "--log-dir", str(tmp_path), "--set", "env=mock/3",
                 "--set", "run.num_envs=4", "--set", "run.total_env_steps=2000", "--set", "run.segment_len=16",
                 "--set", "env_kwargs.episode_len=8"])
    assert code == 0
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["env_steps"] == 2000 and result["trained"] == 2000
    assert (tmp_path / "events.jsonl").read_text().count('"event": "run_end"') == 1
    assert "env steps/s (end to end)" in capsys.readouterr().out
    assert main(["plot", str(tmp_path / "result.json"), "--out", str(tmp_path / "curve.png")]) == 0
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_log_dir_run_log_dir_then_log_dir_then_runs(tmp_path, capsys):
    from pathlib import Path

    from ebrl.cli import resolve_log_dir

    cfg = tmp_path / "run.toml"
    cfg.write_text('env = "mock/3"\n[run]\nlog_dir = "from_file"\n')
    assert resolve_log_dir(build_spec(str(cfg), []), None) == Path("from_file")
    assert resolve_log_dir(build_spec(str(cfg), ["run.log_dir=from_set"]), None) == Path("from_set")
    assert resolve_log_dir(build_spec(None, ["run.log_dir=from_set"]), "cli") == Path("from_set")
    assert "overrides --log-dir cli" in capsys.readouterr().err
    assert resolve_log_dir(build_spec(None, ["env=mock/3"]), "cli") == Path("cli")
    default = resolve_log_dir(build_spec(None, ["env=mock/3"]), None)
    assert default.parent == Path("runs") and default.name.startswith("mock-3-")


def test_bad_config_exits_2_with_the_field_named(tmp_path, capsys):
    code = main(["train", "--quiet", "--log-dir", str(tmp_path), "--set", "run.num_envs=-1", "--set", "env=mock/3"])
    assert code == 2
    assert "num_envs=-1" in capsys.readouterr().err
    # JSON where TOML's inline table was meant: named, not a traceback
    code = main(["train", "--quiet", "--log-dir", str(tmp_path), "--set", 'run.sim={"backend": "process"}',
                 "--set", "env=mock/3"])
    assert code == 2 and "run.sim" in capsys.readouterr().err


def test_policy_kind_follows_the_observations_and_can_be_chosen():
    from ebrl.runs import build_trainer
    from ebrl.policies import CNNPolicy, MLPPolicy

    pixels = build_spec(None, ["env=mujoco/InvertedPendulum-v5", "env_kwargs.pixels=16", "policy.hidden=[32]"])
    assert isinstance(build_trainer(pixels).policy, CNNPolicy)  # auto: pixels -> CNN
    assert isinstance(build_trainer(build_spec(None, ["env=mock/3"])).policy, MLPPolicy)
    with pytest.raises(ConfigError, match="policy.kind.*CNNPolicy needs an image entry"):
        build_trainer(build_spec(None, ["env=mock/3", "policy.kind=cnn"]))
    with pytest.raises(ConfigError, match="policy.kind='rnn'.*auto, mlp, cnn"):
        build_trainer(build_spec(None, ["env=mock/3", "policy.kind=rnn"]))
    # a dict of vectors needs no flattening: the MLP reads every entry (ebrl.policies.encoders)
    fetch = build_trainer(build_spec(None, ["env=robotics/FetchReach-v4", "env_kwargs.flatten=false"])).policy
    assert isinstance(fetch, MLPPolicy) and fetch.obs_dim == 16
    assert [e.key for e in fetch.obs_layout.entries] == ["achieved_goal", "desired_goal", "observation"]


def test_rl_from_sft_weights_keeps_their_observation_statistics(tmp_path):
    from ebrl.runs import build_trainer
    from ebrl.sft import save_sft

    sft = build_trainer(build_spec(None, ["env=mock/3"])).policy
    sft.update_obs_stats(torch.randn(256, 3) * 5 + 2)  # what demonstrations would have set
    save_sft(tmp_path / "sft", sft, {"env": "mock/3", "env_kwargs": {}, "policy": {"kind": "mlp"}}, {})
    shifted = torch.randn(512, 3) * 0.1 - 7  # rollouts somewhere else

    frozen = build_trainer(build_spec(None, ["env=mock/3", f"policy.init={tmp_path / 'sft'}"])).policy
    frozen.update_obs_stats(shifted)
    torch.testing.assert_close(frozen.obs_encoder.obs_mean, sft.obs_encoder.obs_mean)
    torch.testing.assert_close(frozen.obs_encoder.obs_var, sft.obs_encoder.obs_var)
    updating = build_trainer(build_spec(None, ["env=mock/3", f"policy.init={tmp_path / 'sft'}",
                                               "policy.freeze_obs_stats=false"])).policy
    updating.update_obs_stats(shifted)
    assert float(updating.obs_encoder.obs_count) == float(sft.obs_encoder.obs_count) + 512
    assert (updating.obs_encoder.obs_mean < sft.obs_encoder.obs_mean).all()
    fresh = build_trainer(build_spec(None, ["env=mock/3"])).policy  # without policy.init: statistics follow RL
    fresh.update_obs_stats(shifted)
    assert float(fresh.obs_encoder.obs_mean.mean()) < -6
    with pytest.raises(ConfigError, match="policy.freeze_obs_stats.*true or false"):
        build_trainer(build_spec(None, ["env=mock/3", 'policy.freeze_obs_stats="yes"']))


def test_init_std_scale_scales_the_loaded_std(tmp_path):
    from ebrl.runs import build_trainer
    from ebrl.sft import save_sft

    sft = build_trainer(build_spec(None, ["env=mock/3"])).policy
    with torch.no_grad():
        sft.log_std.copy_(torch.tensor([-1.0, -2.0, -3.0])[: sft.log_std.numel()])
    save_sft(tmp_path / "sft", sft, {"env": "mock/3", "env_kwargs": {}, "policy": {"kind": "mlp"}}, {})
    init = f"policy.init={tmp_path / 'sft'}"

    kept = build_trainer(build_spec(None, ["env=mock/3", init])).policy
    torch.testing.assert_close(kept.log_std, sft.log_std)
    halved = build_trainer(build_spec(None, ["env=mock/3", init, "policy.init_std_scale=0.5"])).policy
    torch.testing.assert_close(halved.log_std.exp(), sft.log_std.exp() * 0.5)
    obs = np.zeros((4000, 3), np.float32)  # what the rollouts sample: the actions' spread halves
    spread = [np.std(p.act(obs).actions, axis=0) for p in (kept, halved)]
    np.testing.assert_allclose(spread[1] / spread[0], 0.5, rtol=0.1)

    with pytest.raises(ConfigError, match="policy.init_std_scale.*set that too"):
        build_trainer(build_spec(None, ["env=mock/3", "policy.init_std_scale=0.5"]))
    with pytest.raises(ConfigError, match="policy.init_std_scale.*positive number"):
        build_trainer(build_spec(None, ["env=mock/3", init, "policy.init_std_scale=0"]))


def test_train_from_pixels_end_to_end(tmp_path):
    code = main(["train", "--quiet", "--log-dir", str(tmp_path), "--set", "env=mujoco/InvertedPendulum-v5",
                 "--set", "env_kwargs.pixels=16", "--set", "policy.hidden=[32]", "--set", "run.num_envs=2",
                 "--set", "run.segment_len=16", "--set", "run.total_env_steps=96", "--set", "ppo.minibatch_size=16"])
    assert code == 0
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["env_steps"] == result["trained"] == 96 and result["updates"] >= 1


def test_train_with_vector_envs(tmp_path):
    from ebrl.runs import build_trainer

    spec = build_spec(None, ["env=mock/3", "run.num_envs=4", "run.sim.vector_size=2"])
    venv = build_trainer(spec).env_fn(0)
    assert venv.num_envs == 2
    code = main(["train", "--quiet", "--log-dir", str(tmp_path), "--set", "env=mock/3", "--set", "run.num_envs=4",
                 "--set", "run.sim.vector_size=2", "--set", "run.total_env_steps=640", "--set", "run.segment_len=16"])
    assert code == 0
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["env_steps"] == 640 and result["trained"] + sum(result["dropped"].values()) \
        + result["in_flight_at_stop"] == 640


def _train_args(log_dir, *extra):
    return ["train", "--quiet", "--log-dir", str(log_dir), "--set", "env=mock/3", "--set", "run.num_envs=4",
            "--set", "run.segment_len=16", "--set", "env_kwargs.episode_len=8", *extra]


def test_sigint_stops_cleanly_saves_a_checkpoint_and_resume_continues(tmp_path):
    import os
    import signal
    import threading
    import time

    import torch

    from ebrl.checkpoint import load_checkpoint
    from ebrl.runs import build_spec, build_trainer

    first = tmp_path / "first"
    events = first / "events.jsonl"

    def interrupt_once_running():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if events.exists() and events.read_text().count('"event": "episode"') > 50:  # training is under way
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.05)

    threading.Thread(target=interrupt_once_running, daemon=True).start()
    assert main(_train_args(first, "--set", "run.total_env_steps=5000000")) == 130  # stopped early
    result = json.loads((first / "result.json").read_text())
    assert 0 < result["env_steps"] < 5_000_000
    assert result["env_steps"] == result["trained"] + sum(result["dropped"].values()) + result["in_flight_at_stop"]
    spec = build_spec(None, ["env=mock/3", "run.num_envs=4", "env_kwargs.episode_len=8"])
    saved = build_trainer(spec)
    meta = load_checkpoint(first / "checkpoint.pt", saved)
    assert meta["env_steps"] == result["env_steps"] and meta["stopped_early"]
    assert not any(p.name.startswith(".checkpoint") for p in first.iterdir())  # written by rename, no leftovers

    total = result["env_steps"] + 640
    second = tmp_path / "second"
    assert main(_train_args(second, "--set", f"run.total_env_steps={total}", "--resume",
                            str(first / "checkpoint.pt"))) == 0
    assert json.loads((second / "result.json").read_text())["env_steps"] == 640  # the remainder only
    assert load_checkpoint(second / "checkpoint.pt", build_trainer(spec))["env_steps"] == total
    fresh = build_trainer(spec).policy.state_dict()
    assert any(not torch.equal(fresh[k], v) for k, v in saved.policy.state_dict().items())  # trained weights


def test_resume_from_a_bad_checkpoint_exits_2_naming_it(tmp_path, capsys):
    assert main(_train_args(tmp_path, "--resume", str(tmp_path / "nope.pt"))) == 2
    assert "cannot resume: no checkpoint at" in capsys.readouterr().err
    from ebrl.checkpoint import save_checkpoint
    from ebrl.runs import build_spec, build_trainer

    other = build_trainer(build_spec(None, ["env=mock/5"]))  # another observation size
    save_checkpoint(tmp_path / "other.pt", other, env_steps=10)
    assert main(_train_args(tmp_path, "--resume", str(tmp_path / "other.pt"))) == 2
    assert "does not fit the trainer's MLPPolicy" in capsys.readouterr().err


@pytest.mark.parametrize("learner", ["thread", "process"])
def test_periodic_checkpoints_hold_the_latest_weights_and_algo_state(tmp_path, learner):
    import ebrl
    from ebrl.algos import PPO
    from ebrl.checkpoint import load_checkpoint
    from ebrl.policies import MLPPolicy
    from ebrl.testing import MockEnv

    def trainer(total, every):
        cfg = ebrl.RunConfig(num_envs=4, segment_len=16, total_env_steps=total, learner=learner,
                             log_dir=str(tmp_path), checkpoint_every_s=every)
        return ebrl.Trainer(lambda i: MockEnv(dim=3), MLPPolicy(3, 3, seed=0), PPO(minibatch_size=32), cfg)

    t = trainer(640, 0.0)  # every update
    res = ebrl.run_sync(t)
    other = trainer(640, 0.0)
    meta = load_checkpoint(tmp_path / "checkpoint.pt", other)
    assert meta["periodic"] and meta["updates"] == res.updates and meta["trained"] == res.trained
    for k, v in t.policy.state_dict().items():  # the last update's weights: what the run ended with
        assert torch.equal(other.policy.state_dict()[k], v), k
    assert other.algo.state_dict()["reward_rms"] == t.algo.state_dict()["reward_rms"]
    assert 0 < other.env_steps_done == meta["env_steps"] <= res.env_steps  # steps simulated when it was written
    with pytest.raises(ConfigError, match="checkpoint_every_s.*needs log_dir"):
        ebrl.RunConfig(checkpoint_every_s=10.0)


@pytest.mark.parametrize("args, says", [
    (["--set", "env=mujoco/HalfCheetah-v9"], "unknown env 'mujoco/HalfCheetah-v9'; did you mean"),
    (["--set", "env=mock/3", "--set", "ppo.lr=-1"], "ppo="),
    (["--set", "env=mock/3", "--set", "ppo.learning_rate=0.1"], "learning_rate"),
])
def test_bad_input_to_train_is_one_line_and_exit_code_2(tmp_path, capsys, args, says):
    assert main(["train", "--quiet", "--log-dir", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and "Traceback" not in err


def test_bad_config_files_and_suite_names_are_one_line_and_debug_shows_the_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("run = [unclosed\n")
    assert main(["train", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "config=" in err and "cannot read it" in err and err.count("\n") == 1
    assert main(["train", str(tmp_path / "missing.toml")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["bench", "overhed"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark suite; did you mean overhead?" in err and err.count("\n") == 1
    with pytest.raises(ConfigError, match="unknown benchmark suite"):
        main(["--debug", "bench", "overhed"])


def test_a_second_sigint_aborts_train_at_once(tmp_path, capsys, monkeypatch):
    """The first Ctrl-C waits for the update in flight (held here until the test ends); the
    second cancels the run without waiting for it: exit code 130, "aborted", no traceback, no
    result, and train returns while the update is still held (left to its thread)."""
    import os
    import signal
    import threading
    import time

    from ebrl.algos import PPO

    in_update, release, update_done, aborted = (threading.Event() for _ in range(4))
    update = PPO.update

    def held_update(self, *args, **kw):
        if in_update.is_set():
            return update(self, *args, **kw)
        in_update.set()
        try:
            release.wait(30)  # past it, a train that waits for the update returns after it: the test fails
            return update(self, *args, **kw)
        finally:
            update_done.set()

    monkeypatch.setattr(PPO, "update", held_update)

    def interrupt_twice():
        if not in_update.wait(60):
            return
        os.kill(os.getpid(), signal.SIGINT)  # a stop: it waits for the held update
        time.sleep(0.2)  # (the first is handled before the second comes)
        aborted.set()
        os.kill(os.getpid(), signal.SIGINT)  # the abort

    threading.Thread(target=interrupt_twice, daemon=True).start()
    try:
        code = main(_train_args(tmp_path, "--set", "run.total_env_steps=5000000", "--set", 'run.learner="thread"'))
        held_when_returned = in_update.is_set() and not update_done.is_set()
    finally:
        release.set()
        update_done.wait(10)  # the learner's thread finishes it now, before the next test
    assert code == 130 and aborted.is_set()
    assert held_when_returned  # the abort did not wait for the update in flight
    err = capsys.readouterr().err
    assert "stopping after the update in flight (again to abort)" in err and "ebrl: aborted" in err
    assert "Traceback" not in err
    assert not (tmp_path / "result.json").exists()  # aborted: nothing was summed up


def test_a_sigterm_to_the_process_group_stops_train_cleanly(tmp_path):
    """Slurm, Kubernetes and ``timeout`` signal the whole process group: the sim workers and
    the learner process ignore it, and the parent stops the run as for one Ctrl-C."""
    import os
    import signal
    import subprocess
    import sys
    import time

    args = _train_args(tmp_path, "--set", "run.total_env_steps=50000000", "--set", "run.learner=\"process\"",
                       "--set", 'run.sim={backend = "process", num_workers = 2}')
    proc = subprocess.Popen([sys.executable, "-m", "ebrl", *args], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        events, deadline = tmp_path / "events.jsonl", time.monotonic() + 60
        while not (events.exists() and events.read_text().count('"event": "episode"') > 50):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "ebrl: aborted" not in err and "Traceback" not in err and "died" not in err
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["env_steps"] == result["trained"] + sum(result["dropped"].values()) + result["in_flight_at_stop"]
    assert result["learner_mode"] == "process" and result["sim_backend"] == "process"
