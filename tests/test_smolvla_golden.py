"""SmolVLA against LeRobot's own code: golden outputs of LeRobot 0.4.4's ``VLAFlowMatching``.

``tests/data/smolvla_golden/`` is a tiny random SmolVLA policy folder (``policy/``, written by
``save_random_smolvla``) and its SmolVLM stand-in (``vlm/``); ``tests/data/smolvla_golden.safetensors``
holds fixed inputs (prepared images and masks, language tokens and mask, a padded state, noise,
actions, time) and what LeRobot's own ``VLAFlowMatching.sample_actions`` and ``forward`` (the
per-element flow loss) gave on them, loaded by LeRobot's own ``SmolVLAPolicy.from_pretrained``
(strict) in a separate LeRobot venv: ``tests/data/make_smolvla_golden.py`` says how to rerun it.
Here EBRL's ``SmolVLAModel`` loads the same folder and must give the same, float32 on CPU.

LeRobot 0.4.4 pins transformers<5, whose SmolVLM vision embeddings bucket patch positions one
bucket low (0, 0, 1, ..., N-2 along each side) where transformers 5 computes 0, 1, ..., N-1: the
checkpoints were trained with the former, and EBRL's ``SmolVLAModel`` computes them so
(``lerobot_patch_positions``); with transformers 5's, the actions here differed by up to 0.012.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from safetensors import safe_open
from safetensors.torch import load_file

from ebrl.policies.smolvla.lerobot import SmolVLAFolder
from ebrl.testing_smolvla import save_random_smolvla

pytestmark = pytest.mark.usefixtures("hf_offline")  # conftest: sockets refused, the hub offline

DATA = Path(__file__).parent / "data"
FOLDER, VLM = DATA / "smolvla_golden" / "policy", DATA / "smolvla_golden" / "vlm"
GOLDEN = DATA / "smolvla_golden.safetensors"
# what wrote the committed folder (see make_smolvla_golden.py)
FOLDER_ARGS = {"empty_cameras": 1, "seed": 0, "state_mean": [0.5, -1.0, 0.0, 2.0], "state_std": [1.0, 2.0, 0.5, 1.5],
               "action_mean": [0.1, -0.2, 0.3], "action_std": [0.5, 1.0, 2.0]}


@pytest.fixture(scope="module")
def golden():
    with safe_open(str(GOLDEN), "pt") as f:
        meta = f.metadata()
    g = load_file(str(GOLDEN))
    images = [g[f"image_{i}"] for i in range(3)]
    img_masks = [g[f"img_mask_{i}"] for i in range(3)]
    model = SmolVLAFolder.read(FOLDER).load_model(VLM)
    return model, g, (images, img_masks, g["lang_tokens"], g["lang_masks"], g["state"]), meta


def test_the_golden_outputs_come_from_lerobot(golden):
    _, g, _, meta = golden
    assert meta["lerobot"] == "0.4.4" and meta["transformers"].startswith("4.")
    assert g["sample_actions"].shape == g["noise"].shape == (2, 4, 8)
    assert g["forward_losses"].shape == (2, 4, 8) and not g["img_mask_2"].any()


def test_sample_actions_match_lerobots(golden):
    model, g, inputs, meta = golden
    assert model.settings.num_steps == int(meta["num_steps"]) == 3
    with torch.no_grad():
        out = model.sample_actions(*inputs, noise=g["noise"].clone())
    diff = (out - g["sample_actions"]).abs().max().item()
    assert diff <= 1e-5, f"sample_actions differ from LeRobot's by up to {diff:.3g}"


def test_flow_loss_matches_lerobots_forward(golden):
    model, g, inputs, _ = golden
    with torch.no_grad():
        loss = model.flow_loss(*inputs, g["actions"], g["noise"].clone(), g["time"].clone())
    diff = (loss - g["forward_losses"]).abs().max().item()
    assert diff <= 1e-5, f"flow loss differs from LeRobot's forward by up to {diff:.3g}"


def test_the_committed_folder_is_what_save_random_smolvla_writes(tmp_path):
    """The folder can be regenerated: same weights, bit for bit, from the same arguments."""
    save_random_smolvla(tmp_path / "policy", tmp_path / "vlm", **FOLDER_ARGS)
    assert load_file(str(tmp_path / "policy" / "model.safetensors")).keys() == load_file(
        str(FOLDER / "model.safetensors")).keys()
    fresh, committed = load_file(str(tmp_path / "policy" / "model.safetensors")), load_file(
        str(FOLDER / "model.safetensors"))
    assert all(torch.equal(fresh[k], committed[k]) for k in committed)
