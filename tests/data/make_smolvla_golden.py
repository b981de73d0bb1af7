"""Write ``tests/data/smolvla_golden.safetensors``: LeRobot's own SmolVLA (``VLAFlowMatching``) run on
the tiny random policy folder ``tests/data/smolvla_golden/`` (``policy/`` + its SmolVLM stand-in
``vlm/``), for ``tests/test_smolvla_golden.py`` to compare EBRL's ``SmolVLAModel`` against.

The folder was written by EBRL's own helper (EBRL's venv, from the repository root)::

    python -c "from ebrl.testing_smolvla import save_random_smolvla; save_random_smolvla(
        'tests/data/smolvla_golden/policy', 'tests/data/smolvla_golden/vlm', empty_cameras=1, seed=0,
        state_mean=[0.5, -1.0, 0.0, 2.0], state_std=[1.0, 2.0, 0.5, 1.5],
        action_mean=[0.1, -0.2, 0.3], action_std=[0.5, 1.0, 2.0])"

(EBRL 8a7041e, transformers 5.25, torch 2.13 CPU). It is committed, so the golden test does not
depend on that helper staying the same.

This script runs in a separate LeRobot venv, never EBRL's (LeRobot needs torchvision and pins
torch<2.11). How it was run (2026-12-07; pytorch.org was unreachable, so torch is the 2.13 CPU wheel
and lerobot is installed without its dependencies, with only what SmolVLA's import chain needs)::

    python3.11 -m venv /work/lrvenv
    /work/lrvenv/bin/pip install torch==2.13.0+cpu 'transformers>=4.57.1,<5' draccus==0.10.0 \\
        safetensors 'huggingface-hub<0.36' 'diffusers<0.36' einops num2words accelerate packaging \\
        termcolor deepdiff jsonlines 'datasets>=4,<5' pillow imageio
    /work/lrvenv/bin/pip install --no-deps lerobot==0.4.4
    /work/lrvenv/bin/python tests/data/make_smolvla_golden.py     # from the repository root

torchvision is not installed: a stub stands in for it while LeRobot is imported (only LeRobot's
dataset and other policies' modules import it; SmolVLA's computation never touches it). SmolVLM's
``AutoProcessor`` needs torchvision too (its video processor): ``SmolVLMWithExpertModel`` is given
the tokenizer alone instead (SmolVLA reads only its image-token ids, used only with
``add_image_special_tokens``), from a copy of ``vlm/`` whose ``tokenizer_config.json`` names the
class and special tokens as transformers 4.x reads them. The weights load with LeRobot's own
``SmolVLAPolicy.from_pretrained(..., strict=True)``; only ``vlm_model_name`` is set to the copy.
The tensors are bit-identical from run to run (the metadata's key order may differ).

Inputs (batch 2): two 16x16 cameras in [-1, 1] and an empty third camera (all -1, mask False),
6 random language tokens with the second prompt's last two masked, a state padded to
``max_state_dim``, fixed noise; outputs: ``sample_actions`` (``num_steps`` Euler steps) and the
per-element ``forward`` loss at fixed noise, actions and time. All float32 on CPU.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import shutil
import sys
import tempfile
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
FOLDER, VLM = HERE / "smolvla_golden" / "policy", HERE / "smolvla_golden" / "vlm"
OUT = HERE / "smolvla_golden.safetensors"


class _Stub(types.ModuleType):
    """Any attribute is another stub (a class where capitalised, to subclass); calling one gives one."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():
            return type(name, (), {"__init__": lambda self, *args, **kwargs: None})
        return _Stub(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        return _Stub(self.__name__ + "()")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Stub(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def main() -> None:
    finder = _StubFinder()
    sys.meta_path.insert(0, finder)
    try:
        import lerobot
        import torch
        from lerobot.configs.policies import PreTrainedConfig
        from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig
        from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy, VLAFlowMatching
        from safetensors.torch import save_file
    finally:
        sys.meta_path.remove(finder)

    torch.set_num_threads(1)
    vlm = Path(tempfile.mkdtemp()) / "vlm"
    shutil.copytree(VLM, vlm)
    # the stand-in's tokenizer was saved by transformers 5: name its class and special tokens as 4.x
    # reads them (LeRobot builds SmolVLM's processor beside the model; the computation never uses it)
    tok_config = json.loads((vlm / "tokenizer_config.json").read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_config["extra_special_tokens"] = {k: tok_config[k] for k in (
        "fake_image_token", "image_token", "global_image_token", "end_of_utterance_token")}
    (vlm / "tokenizer_config.json").write_text(json.dumps(tok_config))
    # SmolVLM's full processor needs torchvision (its video processor); SmolVLA reads only the
    # tokenizer's image-token ids from it (and uses them only with add_image_special_tokens)
    import lerobot.policies.smolvla.smolvlm_with_expert as with_expert
    from transformers import AutoTokenizer

    class TokenizerOnlyProcessor:
        @staticmethod
        def from_pretrained(path):
            return types.SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(path))

    with_expert.AutoProcessor = TokenizerOnlyProcessor
    config = PreTrainedConfig.from_pretrained(str(FOLDER))  # LeRobot's own reader of config.json
    assert isinstance(config, SmolVLAConfig)
    config.vlm_model_name = str(vlm)  # LeRobot builds the VLM from AutoConfig (load_vlm_weights=False)
    config.device = "cpu"
    assert not config.load_vlm_weights
    policy = SmolVLAPolicy.from_pretrained(str(FOLDER), config=config, strict=True).eval()
    model = policy.model
    assert isinstance(model, VLAFlowMatching)
    assert all(p.dtype == torch.float32 for p in model.parameters())

    batch = 2
    g = torch.Generator().manual_seed(1)
    images = [torch.rand(batch, 3, 16, 16, generator=g) * 2 - 1 for _ in range(2)]
    images.append(-torch.ones(batch, 3, 16, 16))  # the empty camera, as LeRobot fills it
    img_masks = [torch.ones(batch, dtype=torch.bool), torch.ones(batch, dtype=torch.bool),
                 torch.zeros(batch, dtype=torch.bool)]
    vocab = model.vlm_with_expert.get_vlm_model().text_model.get_input_embeddings().num_embeddings
    lang_tokens = torch.randint(0, vocab, (batch, 6), generator=g)
    lang_masks = torch.ones(batch, 6, dtype=torch.bool)
    lang_masks[-1, 4:] = False
    state = torch.randn(batch, config.max_state_dim, generator=g)
    noise = torch.randn(batch, config.chunk_size, config.max_action_dim, generator=g)
    actions = torch.randn(batch, config.chunk_size, config.max_action_dim, generator=g)
    time = torch.tensor([0.25, 0.8])

    with torch.no_grad():
        sampled = model.sample_actions(images, img_masks, lang_tokens, lang_masks, state, noise=noise.clone())
        losses = model.forward(images, img_masks, lang_tokens, lang_masks, state, actions, noise=noise.clone(),
                               time=time.clone())
    tensors = {f"image_{i}": x.contiguous() for i, x in enumerate(images)}
    tensors.update({f"img_mask_{i}": m.contiguous() for i, m in enumerate(img_masks)})
    tensors.update({"lang_tokens": lang_tokens, "lang_masks": lang_masks, "state": state, "noise": noise,
                    "actions": actions, "time": time, "sample_actions": sampled.contiguous(),
                    "forward_losses": losses.contiguous()})
    metadata = {"lerobot": lerobot.__version__ if hasattr(lerobot, "__version__") else "0.4.4",
                "torch": torch.__version__, "transformers": __import__("transformers").__version__,
                "num_steps": str(config.num_steps)}
    save_file(tensors, str(OUT), metadata=metadata)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes) {metadata}")
    print("sample_actions", sampled.flatten()[:6], "loss mean", losses.mean().item())


if __name__ == "__main__":
    main()
