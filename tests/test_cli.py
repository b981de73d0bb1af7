import json

import pytest

from ebrl.cli import build_spec, main
from ebrl.config import ConfigError


def test_spec_overrides_and_files(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('env = "mock/3"\n[run]\nnum_envs = 4\n[ppo]\nlr = 0.001\n')
    spec = build_spec(str(cfg), ["run.total_env_steps=500", "policy.hidden=[16, 16]"])
    assert spec["env"] == "mock/3" and spec["ppo"]["lr"] == 0.001 and spec["policy"]["hidden"] == [16, 16]
    assert spec["run"]["num_envs"] == 4 and spec["run"]["total_env_steps"] == 500
    assert spec["run"]["segment_len"] == 32  # tables merge over the demo's
    with pytest.raises(ConfigError, match="unknown key"):
        build_spec(None, ["algo.lr=1"])


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


def test_bad_config_exits_2_with_the_field_named(tmp_path, capsys):
    code = main(["train", "--quiet", "--log-dir", str(tmp_path), "--set", "run.num_envs=-1", "--set", "env=mock/3"])
    assert code == 2
    assert "num_envs=-1" in capsys.readouterr().err


def test_policy_kind_follows_the_observations_and_can_be_chosen():
    from ebrl.cli import build_trainer
    from ebrl.policies import CNNPolicy, MLPPolicy

    pixels = build_spec(None, ["env=mujoco/InvertedPendulum-v5", "env_kwargs.pixels=16", "policy.hidden=[32]"])
    assert isinstance(build_trainer(pixels).policy, CNNPolicy)  # auto: pixels -> CNN
    assert isinstance(build_trainer(build_spec(None, ["env=mock/3"])).policy, MLPPolicy)
    with pytest.raises(ConfigError, match="policy.kind.*CNNPolicy needs a Dict"):
        build_trainer(build_spec(None, ["env=mock/3", "policy.kind=cnn"]))
    with pytest.raises(ConfigError, match="policy.kind='rnn'.*auto, mlp, cnn"):
        build_trainer(build_spec(None, ["env=mock/3", "policy.kind=rnn"]))
    with pytest.raises(ConfigError, match="flatten"):
        build_trainer(build_spec(None, ["env=robotics/FetchReach-v4", "env_kwargs.flatten=false"]))


def test_train_from_pixels_end_to_end(tmp_path):
    code = main(["train", "--quiet", "--log-dir", str(tmp_path), "--set", "env=mujoco/InvertedPendulum-v5",
                 "--set", "env_kwargs.pixels=16", "--set", "policy.hidden=[32]", "--set", "run.num_envs=2",
                 "--set", "run.segment_len=16", "--set", "run.total_env_steps=96", "--set", "ppo.minibatch_size=16"])
    assert code == 0
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["env_steps"] == result["trained"] == 96 and result["updates"] >= 1


def test_train_with_vector_envs(tmp_path):
    from ebrl.cli import build_trainer

    spec = build_spec(None, ["env=mock/3", "run.num_envs=4", "run.sim.vector_size=2"])
    venv = build_trainer(spec).env_fn(0)
    assert venv.num_envs == 2
    code = main(["train", "--quiet", "--log-dir", str(tmp_path), "--set", "env=mock/3", "--set", "run.num_envs=4",
                 "--set", "run.sim.vector_size=2", "--set", "run.total_env_steps=640", "--set", "run.segment_len=16"])
    assert code == 0
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["env_steps"] == 640 and result["trained"] + sum(result["dropped"].values()) \
        + result["in_flight_at_stop"] == 640
