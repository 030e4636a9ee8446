"""Loading errors name the problem; both published layouts load."""
import json
import shutil

import numpy as np
import pytest

from engine.checkpoint import _write_safetensors, config_json
from engine.config import ConfigError, ModelConfig
from engine.weights import WeightError, load_weights, mtp_shapes, read_safetensors


def text_cfg(**changes):
    raw = config_json("tiny")
    raw["text_config"].update(changes)
    return raw


@pytest.mark.parametrize("raw,needle", [
    ({**config_json("tiny"), "model_type": "qwen3_5_moe"}, "MoE"),
    ({**config_json("tiny"), "quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    (text_cfg(quantization_config={"quant_method": "awq"}), "awq"),
    (text_cfg(num_key_value_heads=3), "num_key_value_heads"),
    (text_cfg(linear_num_value_heads=5), "linear_num_value_heads"),
    (text_cfg(layer_types=["linear_attention"] * 7 + ["sliding_attention"]), "sliding_attention"),
    (text_cfg(layer_types=["full_attention"] * 3), "layer_types"),
    (text_cfg(num_experts=8), "MoE"),
    ({"model_type": "llama"}, "llama"),
])
def test_unsupported_config_is_named(raw, needle):
    with pytest.raises(ConfigError, match=needle):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "head_dim", "linear_key_head_dim", "vocab_size"])
def test_missing_required_field_is_named(field):
    raw = config_json("tiny")
    del raw["text_config"][field]
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_dict(raw)


def test_both_layouts_and_interval():
    wrapped = config_json("tiny")
    text = dict(wrapped["text_config"], architectures=["Qwen3_5ForCausalLM"])
    del text["layer_types"]  # falls back to full_attention_interval
    a, b = ModelConfig.from_dict(wrapped), ModelConfig.from_dict(text)
    assert a == b
    assert a.full_layers == [3, 7] and a.rotary_dim == 16 and a.rope_theta == 1e7


def test_generation_config_sets_eos_and_defaults(tiny_dir):
    cfg = ModelConfig.from_dir(tiny_dir)
    assert cfg.eos_token_ids == (248046, 248044)
    assert cfg.sampling_defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


@pytest.fixture
def ckpt(tiny_dir, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(tiny_dir, d)
    return d


def _rewrite(d, edit):
    tensors = {k: np.array(v) for k, v in read_safetensors(d / "model.safetensors").items()}
    edit(tensors)
    _write_safetensors(d / "model.safetensors", tensors)


def test_weights_load_and_keep_f32(ckpt):
    cfg = ModelConfig.from_dir(ckpt)
    w = load_weights(ckpt, cfg)
    assert w["layers.0.linear_attn.A_log"].dtype == np.float32
    assert w["layers.0.linear_attn.norm.weight"].dtype == np.float32
    assert w["layers.0.mlp.up_proj.weight"].dtype == np.uint16  # raw bf16 bits
    assert isinstance(w["layers.0.mlp.up_proj.weight"], np.memmap) or w["layers.0.mlp.up_proj.weight"].base is not None


def test_missing_tensor_is_named(ckpt):
    _rewrite(ckpt, lambda t: t.pop("model.language_model.layers.2.linear_attn.dt_bias"))
    with pytest.raises(WeightError, match=r"layers\.2\.linear_attn\.dt_bias.*\[4\]"):
        load_weights(ckpt, ModelConfig.from_dir(ckpt))


def test_unexpected_tensor_is_named(ckpt):
    _rewrite(ckpt, lambda t: t.update({"model.language_model.layers.0.mlp.bias": np.zeros(4, np.float32)}))
    with pytest.raises(WeightError, match=r"unexpected tensor model\.language_model\.layers\.0\.mlp\.bias"):
        load_weights(ckpt, ModelConfig.from_dir(ckpt))


def test_misshaped_tensor_names_both_shapes(ckpt):
    name = "model.language_model.layers.3.self_attn.k_proj.weight"
    _rewrite(ckpt, lambda t: t.update({name: t[name][:64]}))
    with pytest.raises(WeightError, match=r"k_proj\.weight: expected shape \[128, 128\], found \[64, 128\]"):
        load_weights(ckpt, ModelConfig.from_dir(ckpt))


def test_visual_and_mtp_ignored_and_text_only_names(ckpt):
    def edit(t):
        for k in list(t):  # text-only layout: model.* names
            if k.startswith("model.language_model."):
                t["model." + k[len("model.language_model."):]] = t.pop(k)
        t["model.visual.blocks.0.attn.qkv.weight"] = np.zeros((3, 3), np.float32)
        t["mtp.fc.weight"] = np.zeros((3, 3), np.float32)
    _rewrite(ckpt, edit)
    w = load_weights(ckpt, ModelConfig.from_dir(ckpt))
    assert not any(k.startswith(("visual", "mtp")) for k in w)


def test_mtp_head_loaded_for_the_mtp_drafter(ckpt):
    """mtp=True (speculative method "mtp") loads the 15 mtp.* tensors under their names; a checkpoint without
    them is refused with a message that says so, and one missing a tensor names it."""
    cfg = ModelConfig.from_dir(ckpt)
    w = load_weights(ckpt, cfg, mtp=True)
    assert {k: v.shape for k, v in w.items() if k.startswith("mtp.")} == mtp_shapes(cfg)
    _rewrite(ckpt, lambda t: t.pop("mtp.layers.0.mlp.up_proj.weight"))
    with pytest.raises(WeightError, match=r"missing tensor mtp\.layers\.0\.mlp\.up_proj\.weight"):
        load_weights(ckpt, cfg, mtp=True)
    _rewrite(ckpt, lambda t: [t.pop(k) for k in list(t) if k.startswith("mtp.")])
    load_weights(ckpt, cfg)  # serves plainly
    with pytest.raises(WeightError, match=r"no mtp\.\* tensors .* speculative method 'mtp'"):
        load_weights(ckpt, cfg, mtp=True)


def test_make_model_writes_the_mtp_head_as_published(tiny_dir):
    """The checkpoint maker writes the MTP head at top level, 15 tensors (spec-decode-spec §1.2), and
    says so in the config; the loader skips it."""
    cfg = ModelConfig.from_dir(tiny_dir)
    written = {k: v.shape for k, v in read_safetensors(tiny_dir / "model.safetensors").items() if k.startswith("mtp.")}
    assert written == mtp_shapes(cfg) and len(written) == 15
    assert json.loads((tiny_dir / "config.json").read_text())["text_config"]["mtp_num_hidden_layers"] == 1
    assert not any(k.startswith("mtp") for k in load_weights(tiny_dir, cfg))
    m = mtp_shapes(ModelConfig.from_dict(config_json("4b")))  # the 4B rows of the spec's table
    assert (m["mtp.fc.weight"], m["mtp.layers.0.self_attn.q_proj.weight"], m["mtp.layers.0.self_attn.k_proj.weight"],
            m["mtp.layers.0.self_attn.o_proj.weight"], m["mtp.layers.0.self_attn.q_norm.weight"],
            m["mtp.layers.0.mlp.gate_proj.weight"], m["mtp.layers.0.mlp.down_proj.weight"]) == (
        (2560, 5120), (8192, 2560), (1024, 2560), (2560, 4096), (256,), (9216, 2560), (2560, 9216))
    m = mtp_shapes(ModelConfig.from_dict(config_json("27b")))
    assert (m["mtp.fc.weight"], m["mtp.layers.0.self_attn.q_proj.weight"], m["mtp.layers.0.self_attn.o_proj.weight"]) \
        == ((5120, 10240), (12288, 5120), (5120, 6144))


def test_sharded_checkpoint(tmp_path, tiny_dir):
    from engine.checkpoint import make_model
    d = make_model(tmp_path / "sh", "tiny", shard_bytes=20 << 20)  # same seed as tiny_dir: the same tensors
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (tiny_dir / "model.safetensors.index.json").exists()
    sharded, single = load_weights(d, ModelConfig.from_dir(d)), load_weights(tiny_dir, ModelConfig.from_dir(tiny_dir))
    assert sharded.keys() == single.keys()
    for name, w in single.items():
        assert sharded[name].dtype == w.dtype and np.array_equal(sharded[name], w), name


def test_tied_lm_head(tiny3_dir):
    cfg = ModelConfig.from_dir(tiny3_dir)
    w = load_weights(tiny3_dir, cfg)
    assert cfg.tie_word_embeddings and w["lm_head.weight"] is w["embed_tokens.weight"]
