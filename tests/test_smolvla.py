"""SmolVLA (ebrl.policies.smolvla): the network, its inputs and LeRobot's folder layout.

LeRobot's SmolVLA cannot run beside this torch (it needs torchvision), so every block is checked
against its definition written out here from LeRobot's source (``lerobot/policies/smolvla/``): the
weight names against the module structure ``SmolVLMWithExpertModel`` builds, the masks, the rotary
embedding, the attention and the time embedding against their formulas, and whole sampling
against a plain reference of LeRobot's joint prefix-and-suffix pass (``VLAFlowMatching.forward``'s
structure, no cache) in an Euler loop. ``config.json``'s field order is checked against the
dataclasses' source where it is on this machine. Every folder is a tiny random one from
``save_random_smolvla``; sockets are refused.
"""

from __future__ import annotations

import ast
import copy
import json
import math
import os
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from ebrl.policies.pi0.lerobot import ACTION, OBS_STATE
from ebrl.policies.smolvla.attention import attention, make_att_2d_masks, rope, sinusoidal_time_embedding
from ebrl.policies.smolvla.lerobot import (
    LEROBOT_CONFIG_DEFAULTS,
    SmolVLAFolder,
    lerobot_smolvla_config,
    lerobot_state_dict,
    smolvla_pipelines,
    write_smolvla_folder,
)
from ebrl.policies.smolvla.model import expert_intermediate_size
from ebrl.policies.smolvla.preprocess import pad_vector, prepare_images, resize_with_pad, tokenize_prompts
from ebrl.testing_smolvla import save_random_smolvla, save_random_smolvm_dir

pytestmark = pytest.mark.usefixtures("hf_offline")  # conftest: sockets refused, the hub offline
torch.set_num_threads(1)

# LeRobot 0.4.4's source, unpacked (pip download --no-deps lerobot==0.4.4; unzip): the field-order check reads it
LEROBOT_SRC = Path(os.environ.get("EBRL_LEROBOT_SRC", "/work/lerobot-src/whl/lerobot"))
STATS = {"state_mean": [0.5, -1.0, 0.0, 2.0], "state_std": [1.0, 2.0, 0.5, 1.5],
         "action_mean": [0.1, -0.2, 0.3], "action_std": [0.5, 1.0, 2.0]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A folder with two cameras and one empty camera, its VLM directory and the model written."""
    root = tmp_path_factory.mktemp("smolvla")
    model = save_random_smolvla(root / "policy", root / "vlm", empty_cameras=1, **STATS)
    return root / "policy", root / "vlm", model


def inputs(model, batch=2, seed=1):
    """Random prepared inputs: two cameras and one empty one, prompts of unequal length, a state."""
    g = torch.Generator().manual_seed(seed)
    s = model.settings
    images = [torch.rand(batch, 3, 16, 16, generator=g) * 2 - 1 for _ in range(3)]
    masks = [torch.ones(batch, dtype=torch.bool), torch.ones(batch, dtype=torch.bool),
             torch.zeros(batch, dtype=torch.bool)]
    images[2] = -torch.ones_like(images[2])
    vocab = model.vlm_with_expert.text_model.get_input_embeddings().num_embeddings
    tokens = torch.randint(0, vocab, (batch, 6), generator=g)
    lang_masks = torch.ones(batch, 6, dtype=torch.bool)
    lang_masks[-1, 4:] = False
    state = torch.randn(batch, s.max_state_dim, generator=g)
    return images, masks, tokens, lang_masks, state


# ---- definitions written out from LeRobot's source ------------------------------------------------

def ref_masks(pad, att):
    """make_att_2d_masks by its definition: i sees j iff both are real and cumsum(att)[j] <= cumsum(att)[i]."""
    b, n = pad.shape
    out = torch.zeros(b, n, n, dtype=torch.bool)
    for k in range(b):
        c = [int(att[k, : i + 1].sum()) for i in range(n)]
        for i in range(n):
            for j in range(n):
                out[k, i, j] = bool(pad[k, i] and pad[k, j] and c[j] <= c[i])
    return out


def ref_rope(x, pos):
    """Rotation of the pairs (i, i + D/2) by pos / 10000**(2i/D), as complex numbers."""
    half = x.shape[-1] // 2
    freq = torch.tensor([10_000 ** (-2 * i / x.shape[-1]) for i in range(half)], dtype=torch.float64)
    angle = pos.double()[..., None, None] * freq
    z = torch.complex(x[..., :half].double(), x[..., half:].double()) * torch.exp(1j * angle)
    return torch.cat([z.real, z.imag], -1).to(x.dtype)


def ref_attention(q, k, v, mask, d):
    """Per head h (reading key/value head h // groups): softmax(q k^T / sqrt(d), masked keys at
    finfo.min) v."""
    b, lq, heads, hd = q.shape
    groups = heads // k.shape[2]
    out = torch.zeros(b, lq, heads, hd)
    for h in range(heads):
        logits = q[:, :, h].float() @ k[:, :, h // groups].float().transpose(1, 2) / math.sqrt(d)
        logits = torch.where(mask, logits, torch.finfo(torch.float32).min)
        out[:, :, h] = torch.softmax(logits, -1) @ v[:, :, h // groups].float()
    return out.reshape(b, lq, heads * hd)


def ref_time(t, dim, lo, hi):
    half = dim // 2
    rows = []
    for tb in t.tolist():
        periods = [lo * (hi / lo) ** (i / (half - 1)) for i in range(half)]
        rows.append([math.sin(2 * math.pi * tb / p) for p in periods] + [math.cos(2 * math.pi * tb / p)
                                                                         for p in periods])
    return torch.tensor(rows, dtype=torch.float64)


def ref_velocity(model, images, img_masks, tokens, lang_masks, state, x_t, t):
    """LeRobot's joint pass (VLAFlowMatching.forward's: prefix and suffix in one sequence, no
    cache) written plainly with the model's weights."""
    vwe, s = model.vlm_with_expert, model.settings
    vlm = vwe.vlm.model
    prefix, pad, att = [], [], []
    for img, m in zip(images, img_masks):
        emb = vlm.connector(vlm.vision_model(pixel_values=img).last_hidden_state)
        prefix.append(emb * math.sqrt(emb.shape[-1]))
        pad.append(m[:, None].expand(-1, emb.shape[1]))
        att += [0] * emb.shape[1]
    lang = vlm.text_model.embed_tokens(tokens)
    prefix.append(lang * math.sqrt(lang.shape[-1]))
    pad.append(lang_masks)
    att += [0] * tokens.shape[1]
    prefix.append(model.state_proj(state)[:, None])
    pad.append(torch.ones(state.shape[0], 1, dtype=torch.bool))
    att += [1]
    hp = torch.cat(prefix, 1)
    lp = hp.shape[1]
    time = ref_time(t, vwe.expert_hidden_size, s.min_period, s.max_period).float()
    a = model.action_in_proj(x_t)
    hs = model.action_time_mlp_out(F.silu(model.action_time_mlp_in(torch.cat([a, time[:, None].expand_as(a)], -1))))
    pad = torch.cat(pad + [torch.ones(hs.shape[:2], dtype=torch.bool)], 1)
    att = torch.tensor(att + [1] * hs.shape[1])[None].expand(hs.shape[0], -1)
    mask = ref_masks(pad, att)
    pos = torch.cumsum(pad, 1) - 1
    d = vwe.head_dim

    def qkv(layer, h):
        a = layer.self_attn
        n = layer.input_layernorm(h)
        return [p(n).unflatten(-1, (-1, d)) for p in (a.q_proj, a.k_proj, a.v_proj)]

    def finish(layer, h, o):
        h = layer.self_attn.o_proj(o) + h
        return layer.mlp(layer.post_attention_layernorm(h)) + h

    for i, (lv, le) in enumerate(zip(vwe.text_model.layers, vwe.lm_expert.layers)):
        qp, kp, vp = qkv(lv, hp)
        if i % s.self_attn_every_n_layers == 0:  # joint self-attention over prefix and suffix
            qs, ks, vs = qkv(le, hs)
            q, k, v = (torch.cat(p, 1) for p in ((qp, qs), (kp, ks), (vp, vs)))
            o = ref_attention(ref_rope(q, pos), ref_rope(k, pos), v, mask, d)
            op, os_ = o[:, :lp], o[:, lp:]
        else:  # the prefix attends to itself; the expert's queries to its projection of the prefix's keys/values
            kr = ref_rope(kp, pos[:, :lp])
            op = ref_attention(ref_rope(qp, pos[:, :lp]), kr, vp, mask[:, :lp, :lp], d)
            a_ = le.self_attn
            qs = a_.q_proj(le.input_layernorm(hs)).unflatten(-1, (-1, d))
            spos = pos[:, lp:] - pos[:, lp:].min(1, keepdim=True).values
            ks = a_.k_proj(kr.flatten(2)).unflatten(-1, (-1, d))
            vs = a_.v_proj(vp.flatten(2)).unflatten(-1, (-1, d))
            os_ = ref_attention(ref_rope(qs, spos), ks, vs, mask[:, lp:, :lp], d)
        hp, hs = finish(lv, hp, op), finish(le, hs, os_)
    return model.action_out_proj(vwe.lm_expert.norm(hs))


# ---- blocks ----------------------------------------------------------------------------------------

def test_masks_rope_attention_and_time_embedding_follow_their_definitions():
    g = torch.Generator().manual_seed(0)
    pad = torch.tensor([[1, 1, 1, 1, 0, 1, 1, 1], [1, 0, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    att = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1, 0, 1]])
    assert torch.equal(make_att_2d_masks(pad, att), ref_masks(pad, att))
    # the prefix is one block (images + prompt) then the state; the actions are causal after it
    m = make_att_2d_masks(pad, att)[0]
    assert m[:4, :4].all() and not m[:4, 5:].any() and m[5, :4].all() and m[7, 5:8].all() and not m[5, 6]
    x = torch.randn(2, 5, 3, 8, generator=g)
    pos = torch.randint(0, 40, (2, 5), generator=g)
    assert torch.allclose(rope(x, pos), ref_rope(x, pos), atol=1e-5)
    q, k, v = torch.randn(2, 4, 6, 8, generator=g), torch.randn(2, 7, 2, 8, generator=g), torch.randn(2, 7, 2, 8)
    mask = torch.rand(2, 4, 7, generator=g) > 0.3
    mask[1, 2] = False  # a row that sees nothing averages every key, as LeRobot's finfo.min does
    assert torch.allclose(attention(q, k, v, mask, 8), ref_attention(q, k, v, mask, 8), atol=1e-6)
    t = torch.tensor([0.0, 0.37, 1.0])
    assert torch.allclose(sinusoidal_time_embedding(t, 24, 4e-3, 4.0), ref_time(t, 24, 4e-3, 4.0), atol=1e-10)
    assert [expert_intermediate_size(h) for h in (720, 24, 1536)] == [2048, 256, 4096]


def test_velocity_and_sampling_match_lerobots_joint_pass(tiny):
    _, _, model = tiny
    images, masks, tokens, lang_masks, state = inputs(model)
    s = model.settings
    g = torch.Generator().manual_seed(2)
    noise = torch.randn(2, s.chunk_size, s.max_action_dim, generator=g)
    with torch.no_grad():
        prefix = model.prefix_kv(images, masks, tokens, lang_masks, state)
        t = torch.tensor([0.9, 0.3])
        v = model.velocity(prefix, noise, t)
        assert torch.allclose(v, ref_velocity(model, images, masks, tokens, lang_masks, state, noise, t), atol=1e-5)
        # the reference ODE: Euler from t = 1 to 0 with dt = -1 / num_steps
        x = noise.clone()
        for step in range(s.num_steps):
            tt = torch.full((2,), 1.0 - step / s.num_steps)
            x = x + (-1.0 / s.num_steps) * ref_velocity(model, images, masks, tokens, lang_masks, state, x, tt)
        out = model.sample_actions(images, masks, tokens, lang_masks, state, noise=noise)
        assert out.shape == noise.shape and torch.allclose(out, x, atol=1e-5)
        # the empty camera is masked out: what its pixels hold changes nothing
        other = [*images[:2], torch.rand_like(images[2])]
        assert torch.allclose(model.sample_actions(other, masks, tokens, lang_masks, state, noise=noise), out,
                              atol=1e-6)
        # the SFT loss: velocity at x_t = t noise + (1 - t) actions against noise - actions
        actions, time = torch.randn(noise.shape, generator=g), torch.tensor([0.25, 0.8])
        loss = model.flow_loss(images, masks, tokens, lang_masks, state, actions, noise, time)
        x_t = time[:, None, None] * noise + (1 - time[:, None, None]) * actions
        ref = ref_velocity(model, images, masks, tokens, lang_masks, state, x_t, time)
        assert torch.allclose(loss, (noise - actions - ref) ** 2, atol=1e-5)


# ---- inputs ----------------------------------------------------------------------------------------

def test_resize_with_pad_keeps_the_aspect_and_pads_left_and_top():
    img = torch.rand(1, 3, 8, 12)  # wide: scaled by 16/12 to 10 x 16, padded on top
    out = resize_with_pad(img, 16, 16, pad_value=0)
    assert out.shape == (1, 3, 16, 16) and (out[:, :, :6] == 0).all()
    assert torch.equal(out[:, :, 6:], F.interpolate(img, size=(10, 16), mode="bilinear", align_corners=False))
    tall = torch.rand(1, 3, 20, 10)  # tall: 16 x 8, padded on the left
    out = resize_with_pad(tall, 16, 16, pad_value=-1)
    assert (out[..., :8] == -1).all() and not (out[..., 8:] == -1).any()
    same = torch.rand(2, 3, 16, 16)
    assert torch.allclose(resize_with_pad(same, 16, 16), same)
    # a constant 5 x 9 image (scaled by 16/9 to 8 x 16) stays constant where it is not padding
    assert torch.allclose(resize_with_pad(torch.full((1, 3, 5, 9), 0.3), 16, 16)[..., 8:, :], torch.tensor(0.3))


def test_two_cameras_and_an_empty_one_are_prepared_as_lerobot_does(tiny):
    path, vlm, model = tiny
    proc = SmolVLAFolder.read(path).processing()
    assert proc["image_features"][-1] == "observation.images.empty_camera_0" and proc["empty_cameras"] == 1
    frames = {"observation.images.camera1": torch.rand(2, 3, 8, 12),
              "observation.images.camera2": torch.rand(2, 1, 3, 16, 16)}  # [B, T, C, H, W]: the last step
    images, masks = prepare_images(frames, proc["image_features"], resize=proc["resize"], empty_cameras=1)
    assert len(images) == 3 and [m.tolist() for m in masks] == [[True, True], [True, True], [False, False]]
    assert torch.allclose(images[0], resize_with_pad(frames["observation.images.camera1"], 16, 16, 0) * 2 - 1)
    assert (images[0][:, :, :6] == -1).all()  # padding is 0 in [0, 1], -1 after
    assert torch.equal(images[1], frames["observation.images.camera2"][:, -1] * 2 - 1)
    assert (images[2] == -1).all()
    # a camera missing from the batch becomes an empty one only while empty_cameras allows
    images, masks = prepare_images({"observation.images.camera1": frames["observation.images.camera1"]},
                                   proc["image_features"], resize=proc["resize"], empty_cameras=1)
    assert len(images) == 2 and not masks[1].any()
    with pytest.raises(ValueError, match="at least one"):
        prepare_images({}, proc["image_features"], resize=proc["resize"])
    assert torch.equal(pad_vector(torch.ones(2, 3), 5), torch.tensor([[1.0, 1, 1, 0, 0]] * 2))
    tokenizer = SmolVLAFolder.read(path).tokenizer(vlm)
    tokens, lang_masks = tokenize_prompts(tokenizer, ["reach the goal", "pick up the red block\n"], max_length=12)
    newline = tokenizer.convert_tokens_to_ids("\n")
    assert tokens.shape == (2, 6) and lang_masks.sum(1).tolist() == [4, 6]  # each prompt ends with "\n" once
    assert tokens[0, 3] == newline and tokens[1, 5] == newline and not lang_masks[0, 4:].any()
    tokens, _ = tokenize_prompts(tokenizer, "reach the goal", max_length=12, padding="max_length")
    assert tokens.shape == (1, 12)
    with torch.no_grad():
        images, masks = prepare_images(frames, proc["image_features"], resize=proc["resize"], empty_cameras=1)
        state = pad_vector(proc["state"].normalize(torch.randn(2, 4)), proc["max_state_dim"])
        tokens, lang_masks = tokenize_prompts(tokenizer, ["reach the goal"] * 2, max_length=12)
        actions = model.sample_actions(images, masks, tokens, lang_masks, state)
    assert actions.shape == (2, 4, 8) and torch.isfinite(actions).all()


# ---- the folder ------------------------------------------------------------------------------------

def lerobot_names_and_shapes(vlm_config, num_vlm_layers, max_dim):
    """The names and shapes of SmolVLAPolicy.state_dict(), built as SmolVLMWithExpertModel and
    VLAFlowMatching build their modules (smolvlm_with_expert.py, modeling_smolvla.py)."""
    from transformers import AutoModel, SmolVLMForConditionalGeneration

    with torch.device("meta"):
        vlm = SmolVLMForConditionalGeneration(vlm_config)
        vlm.model.text_model.layers = vlm.model.text_model.layers[:num_vlm_layers]
        cfg = copy.deepcopy(vlm_config.text_config)
        cfg.hidden_size = int(vlm_config.text_config.hidden_size * 0.75)
        cfg.intermediate_size = expert_intermediate_size(cfg.hidden_size)
        cfg.num_hidden_layers = num_vlm_layers
        expert = AutoModel.from_config(cfg)
        kv = vlm_config.text_config.num_key_value_heads * vlm_config.text_config.head_dim
        for i in range(num_vlm_layers):
            if i % 2:
                expert.layers[i].self_attn.k_proj = torch.nn.Linear(kv, cfg.num_key_value_heads * cfg.head_dim,
                                                                    bias=False)
                expert.layers[i].self_attn.v_proj = torch.nn.Linear(kv, cfg.num_key_value_heads * cfg.head_dim,
                                                                    bias=False)
        expert.embed_tokens = None
    out = {f"model.vlm_with_expert.vlm.{k}": tuple(v.shape) for k, v in vlm.state_dict().items()}
    out.update({f"model.vlm_with_expert.lm_expert.{k}": tuple(v.shape) for k, v in expert.state_dict().items()})
    h, w = vlm_config.text_config.hidden_size, cfg.hidden_size
    for name, shape in (("state_proj", (h, max_dim)), ("action_in_proj", (w, max_dim)),
                        ("action_out_proj", (max_dim, w)), ("action_time_mlp_in", (w, 2 * w)),
                        ("action_time_mlp_out", (w, w))):
        out[f"model.{name}.weight"], out[f"model.{name}.bias"] = shape, (shape[0],)
    return out


def test_the_weights_carry_lerobots_names_and_the_folder_round_trips_bit_for_bit(tiny, tmp_path):
    path, vlm, model = tiny
    folder = SmolVLAFolder.read(path)
    vlm_config = folder.vlm_config(vlm)
    assert vlm_config.text_config.num_hidden_layers == 6  # cut to num_vlm_layers=4 in the policy
    assert folder.shapes == lerobot_names_and_shapes(vlm_config, 4, 8)
    loaded = folder.load_model(vlm)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    # as read: config, weights and pipelines written back
    config = lerobot_smolvla_config(folder.settings(), folder.config["input_features"],
                                    folder.config["output_features"], source=folder.config)
    write_smolvla_folder(tmp_path / "read", config, lerobot_state_dict(loaded), folder.pipelines())
    # from scratch: LeRobot's field order and pipelines, the statistics the normaliser held
    stats = folder.pipelines()["policy_preprocessor"][1][5]
    fresh = lerobot_smolvla_config(folder.settings(), folder.config["input_features"],
                                   folder.config["output_features"], empty_cameras=1,
                                   normalization_mapping=folder.config["normalization_mapping"],
                                   n_action_steps=4, resize_imgs_with_padding=[16, 16], tokenizer_max_length=12)
    write_smolvla_folder(tmp_path / "fresh", fresh, lerobot_state_dict(loaded), smolvla_pipelines(fresh, stats))
    names = sorted(p.name for p in path.iterdir())
    assert len(names) == 6
    for out in ("read", "fresh"):
        assert sorted(p.name for p in (tmp_path / out).iterdir()) == names
        for name in names:
            assert (tmp_path / out / name).read_bytes() == (path / name).read_bytes(), (out, name)
    pre = json.loads((path / "policy_preprocessor.json").read_text())
    assert [s["registry_name"] for s in pre["steps"]] == [
        "rename_observations_processor", "to_batch_processor", "smolvla_new_line_processor", "tokenizer_processor",
        "device_processor", "normalizer_processor"]
    assert pre["steps"][3]["config"]["tokenizer_name"] == "HuggingFaceTB/SmolVLM2-500M-Video-Instruct"
    assert pre["steps"][5]["state_file"] == "policy_preprocessor_step_5_normalizer_processor.safetensors"


def _dataclass_fields(source: Path, cls: str) -> dict[str, ast.expr | None]:
    tree = ast.parse(source.read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    return {s.target.id: s.value for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


@pytest.mark.skipif(not LEROBOT_SRC.is_dir(), reason="LeRobot 0.4.4's source is not unpacked here: set EBRL_LEROBOT_SRC to its lerobot/ folder")
def test_config_json_has_lerobots_fields_in_order_with_their_defaults():
    base = _dataclass_fields(LEROBOT_SRC / "configs/policies.py", "PreTrainedConfig")
    own = _dataclass_fields(LEROBOT_SRC / "policies/smolvla/configuration_smolvla.py", "SmolVLAConfig")
    fields = {**base, **own}  # a redeclared field keeps its first place, as dataclasses do
    assert ["type", *fields] == list(LEROBOT_CONFIG_DEFAULTS)
    for name, value in fields.items():
        if name == "push_to_hub":  # True there; EBRL writes False (lerobot-train then needs no repo_id)
            continue
        if isinstance(value, ast.Call):  # field(default_factory=...): the normalisation mapping, empty dicts
            text = ast.unparse(value)
            if name == "normalization_mapping":  # {"VISUAL": NormalizationMode.IDENTITY, ...}
                table = next(n for n in ast.walk(value) if isinstance(n, ast.Dict))
                expected = {k.value: v.attr for k, v in zip(table.keys, table.values)}
                assert LEROBOT_CONFIG_DEFAULTS[name] == expected
            else:
                assert text == "field(default_factory=dict)" and LEROBOT_CONFIG_DEFAULTS[name] == {}
            continue
        default = ast.literal_eval(value)
        default = list(default) if isinstance(default, tuple) else default
        assert LEROBOT_CONFIG_DEFAULTS[name] == default and type(LEROBOT_CONFIG_DEFAULTS[name]) is type(default), name


@pytest.mark.parametrize("mode", ["IDENTITY", "MEAN_STD", "MIN_MAX", "QUANTILES", "QUANTILE10"])
def test_every_normalisation_mode_follows_lerobots_formula(mode, tmp_path):
    save_random_smolvla(tmp_path / "p", tmp_path / "vlm", norm_modes={"STATE": mode, "ACTION": mode}, **STATS)
    folder = SmolVLAFolder.read(tmp_path / "p")
    m, s = torch.tensor(STATS["state_mean"]), torch.tensor(STATS["state_std"])
    am, as_ = torch.tensor(STATS["action_mean"]), torch.tensor(STATS["action_std"])
    x, y = torch.randn(3, 4), torch.randn(3, 3)
    lo, hi = {"MEAN_STD": (m, s), "MIN_MAX": (m - 2 * s, m + 2 * s), "QUANTILES": (m - 2 * s, m + 2 * s),
              "QUANTILE10": (m - 1.28 * s, m + 1.28 * s)}.get(mode, (None, None))
    alo, ahi = {"MEAN_STD": (am, as_), "MIN_MAX": (am - 2 * as_, am + 2 * as_),
                "QUANTILES": (am - 2 * as_, am + 2 * as_),
                "QUANTILE10": (am - 1.28 * as_, am + 1.28 * as_)}.get(mode, (None, None))
    if mode == "IDENTITY":
        want_x, want_y = x, y
    elif mode == "MEAN_STD":  # NormalizerProcessorStep: (x - mean) / (std + eps); unnormalise: y std + mean
        want_x, want_y = (x - lo) / (hi + 1e-8), y * ahi + alo
    else:  # 2 (x - lo) / (hi - lo) - 1; unnormalise: (y + 1) (hi - lo) / 2 + lo
        want_x, want_y = 2 * (x - lo) / (hi - lo) - 1, (y + 1) * (ahi - alo) / 2 + alo
    proc = folder.processing()
    assert torch.allclose(proc["state"].normalize(x), want_x, atol=1e-5)
    assert torch.allclose(proc["actions"].unnormalize(y), want_y, atol=1e-5)


def test_bad_input_is_one_clear_error(tiny, tmp_path):
    path, _, _ = tiny
    folder = SmolVLAFolder.read(path)
    with pytest.raises(FileNotFoundError, match=r"HuggingFaceTB/SmolVLM2-500M-Video-Instruct.*vlm=DIR"):
        folder.load_model(None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"has no config.json and no tokenizer.*SmolVLM2-500M"):
        folder.tokenizer(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        SmolVLAFolder.read(tmp_path / "nowhere")
    # a VLM of other sizes than the weights': one error naming what differs
    save_random_smolvm_dir(tmp_path / "wide", hidden=48)
    with pytest.raises(ValueError, match=r"does not fit .*wrong shapes"):
        folder.load_model(tmp_path / "wide")
    # a feature the env mismatches: both sides listed
    box = gym.spaces.Box(0, 255, (16, 16, 3), np.uint8)
    space = gym.spaces.Dict({"camera1": box, "camera2": box, "state": gym.spaces.Box(-1, 1, (5,), np.float32)})
    with pytest.raises(ValueError, match=r"observation.state \(shape \[4\]\) reads 'state' of 5 elements"):
        folder.env_keys(space, 3)
    space = gym.spaces.Dict({"camera1": box, "camera2": box, "state": gym.spaces.Box(-1, 1, (4,), np.float32)})
    assert folder.env_keys(space, 3) == (["camera1", "camera2"], ["state"])
    assert folder.features()[OBS_STATE]["shape"] == [4] and folder.features()[ACTION]["shape"] == [3]
