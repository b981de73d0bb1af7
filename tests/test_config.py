import pytest

import ebrl
from ebrl.config import ConfigError, RunConfig, load_file, parse_setting


@pytest.mark.parametrize("kwargs, field, allowed", [
    ({"num_envs": 0}, "num_envs", "integer >= 1"),
    ({"schedule": "lockstep"}, "schedule", "'auto', 'async', 'sync', 'pipelined'"),
    ({"segment_cut": "episodes"}, "segment_cut", "'auto', 'length', 'episode', 'stream'"),
    ({"sim": {"backend": "gpu"}}, "sim.backend", "'auto', 'inline', 'thread', 'process'"),
    ({"sim": {"thread": 2}}, "sim.thread", "unknown field"),
    ({"generation": {"max_wait_s": -1}}, "generation.max_wait_s", ">= 0"),
    ({"faults": {"nonfinite": "ignore"}}, "faults.nonfinite", "'raise', 'drop'"),
    ({"max_policy_lag": 1.5}, "max_policy_lag", "integer >= 0"),
    ({"schedule": "pipelined", "num_envs": 2, "num_groups": 3}, "num_groups", "<= num_envs"),
])
def test_bad_values_name_field_value_and_what_is_allowed(kwargs, field, allowed):
    with pytest.raises(ConfigError) as err:
        RunConfig(**kwargs)
    assert err.value.field == field
    assert str(err.value).startswith(field + "=") and allowed in str(err.value)


def test_overrides_parse_values_and_reach_nested_fields():
    cfg = RunConfig().with_overrides(["num_envs=32", "schedule=sync", "sim.backend=thread",
                                      "generation.max_wait_s=1e-3", "log_dir=runs/x"])
    assert (cfg.num_envs, cfg.schedule, cfg.sim.backend, cfg.generation.max_wait_s, cfg.log_dir) == (
        32, "sync", "thread", 1e-3, "runs/x")
    # schedule and segment_cut default to auto: the algorithm's needs, resolved when the run starts
    default = RunConfig()
    assert (default.schedule, default.segment_cut, default.reset_group) == ("auto", "auto", None)
    assert RunConfig.from_dict(default.to_dict()) == default
    assert default.with_overrides(["segment_cut=length"]).segment_cut == "length"
    with pytest.raises(ConfigError, match="num_env=.*unknown field"):
        RunConfig().with_overrides(["num_env=3"])
    with pytest.raises(ConfigError, match="key=value"):
        RunConfig().with_overrides(["num_envs"])
    with pytest.raises(ConfigError, match="key=value"):
        RunConfig().with_overrides([" =3"])


def test_every_key_value_flag_parses_one_way():
    from ebrl.runs import build_spec
    from ebrl.cli_demos import _env_kwargs

    assert parse_setting(" sim.backend = thread ") == ("sim.backend", "thread")
    assert _env_kwargs(["pixels=64", "flatten=false", "camera=front"]) == {"pixels": 64, "flatten": False,
                                                                          "camera": "front"}
    with pytest.raises(ConfigError, match="^--env-kwarg='pixels': must look like key=value, e.g. pixels=64"):
        _env_kwargs(["pixels"])
    # the spec's error names the value as it was parsed, as RunConfig's do
    with pytest.raises(ConfigError, match=r"polcy.hidden=\[32\]: unknown key"):
        build_spec(None, ["polcy.hidden=[32]"])


def test_toml_file_round_trip(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('num_envs = 4\nschedule = "pipelined"\nsegment_cut = "auto"\n[sim]\nbackend = "inline"\n')
    cfg = RunConfig.from_dict(load_file(path))
    assert cfg.num_envs == 4 and cfg.sim.backend == "inline" and cfg.segment_cut == "auto"
    with pytest.raises(ConfigError, match="no such file"):
        load_file(tmp_path / "missing.toml")


def test_trainer_rejects_things_that_are_not_policies_or_algorithms():
    from ebrl.testing import MockEnv, MockPolicy, NoopAlgo

    with pytest.raises(ConfigError, match="policy=.*act"):
        ebrl.Trainer(lambda i: MockEnv(), object(), NoopAlgo())
    with pytest.raises(ConfigError, match="algo=.*update"):
        ebrl.Trainer(lambda i: MockEnv(), MockPolicy(), object())
