"""attnlab.swap in the real third-party models, built from tiny configs with random init.

One test per client family: the model's outputs before the swap are compared with its outputs
after ``attnlab.swap(model, verify=x)`` (which itself checks flash-attention's 2x rule against a
float64 copy), and also with a direct max-abs-difference bound. Nothing is downloaded:
``pretrained=False`` / no pretrained tag everywhere.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import attnlab
from attnlab.compat import FusedQKVAttention, MultiheadAttention

BOUND = 1e-5  # float32, outputs of order 1


def _max_diff(a: Tensor, b: Tensor) -> float:
    return float((a - b).detach().abs().max())


def _eval_out(model: nn.Module, *args: object, **kwargs: object) -> Tensor:
    with torch.no_grad():
        out = model(*args, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def test_torchvision_vit() -> None:
    vit_module = pytest.importorskip("torchvision.models.vision_transformer")
    torch.manual_seed(0)
    model = vit_module.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64
    ).eval()
    x = torch.randn(2, 3, 32, 32)
    before = _eval_out(model, x)
    report = attnlab.swap(model, verify=x)
    assert report.swapped_paths == [f"encoder.layers.encoder_layer_{i}.self_attention" for i in range(2)]
    assert all(type(model.get_submodule(p)) is MultiheadAttention for p in report.swapped_paths)
    assert _max_diff(_eval_out(model, x), before) <= BOUND


@pytest.mark.parametrize("variant", ["plain", "qk_norm", "attn_mask"])
def test_timm_vit(variant: str) -> None:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=32,
        patch_size=8,
        depth=2,
        embed_dim=32,
        num_heads=2,
        num_classes=5,
        qkv_bias=True,
        qk_norm=variant == "qk_norm",
    ).eval()
    if variant == "qk_norm":
        with torch.no_grad():  # LayerNorm's default init (1, 0) would hide a norm that is not applied
            for blk in model.blocks:
                for norm in (blk.attn.q_norm, blk.attn.k_norm):
                    norm.weight.uniform_(0.5, 1.5)
                    norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(2, 3, 32, 32)
    kwargs: dict[str, object] = {}
    if variant == "attn_mask":
        N = 1 + 16  # class token + (32 / 8)^2 patches
        keep = torch.rand(N, N) > 0.3  # timm passes it to SDPA: True = may attend
        keep.fill_diagonal_(True)
        kwargs = {"attn_mask": keep}
    before = _eval_out(model, x, **kwargs)
    report = attnlab.swap(model, verify={"x": x, **kwargs})
    assert report.swapped_paths == ["blocks.0.attn", "blocks.1.attn"]
    assert all(isinstance(model.get_submodule(p), FusedQKVAttention) for p in report.swapped_paths)
    assert _max_diff(_eval_out(model, x, **kwargs), before) <= BOUND


def test_timm_training_step_gradients_match() -> None:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    kw = dict(pretrained=False, img_size=32, patch_size=8, depth=1, embed_dim=32, num_heads=2, num_classes=3)
    original = timm.create_model("vit_tiny_patch16_224", qk_norm=True, **kw).train()
    swapped = timm.create_model("vit_tiny_patch16_224", qk_norm=True, **kw).train()
    swapped.load_state_dict(original.state_dict())
    attnlab.swap(swapped)
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([0, 2])
    for m in (original, swapped):
        nn.functional.cross_entropy(m(x), y).backward()
    g_orig = {n: p.grad for n, p in original.named_parameters()}
    g_ours = {n: p.grad for n, p in swapped.named_parameters()}
    qkv_grad = g_orig.pop("blocks.0.attn.qkv.weight")
    split = torch.cat([g_ours.pop(f"blocks.0.attn.{n}_proj.weight") for n in "qkv"])  # (3E, E): rows Q, K, V
    assert _max_diff(split, qkv_grad) <= 1e-5
    qkv_bias_grad = g_orig.pop("blocks.0.attn.qkv.bias")
    assert _max_diff(torch.cat([g_ours.pop(f"blocks.0.attn.{n}_proj.bias") for n in "qkv"]), qkv_bias_grad) <= 1e-5
    g_orig = {
        n.replace("attn.proj.", "attn.out_proj.").replace("attn.norm.", "attn.inner_norm."): g
        for n, g in g_orig.items()
    }
    assert g_orig.keys() == g_ours.keys()
    for name, g in g_orig.items():
        assert _max_diff(g_ours[name], g) <= 1e-5, name


@pytest.mark.slow  # ~8 s on 2 shared cores, most of it importing open_clip (the model itself runs in < 1 s)
def test_open_clip_clip() -> None:
    open_clip = pytest.importorskip("open_clip")
    torch.manual_seed(0)
    model = open_clip.model.CLIP(
        embed_dim=16,
        vision_cfg={
            "layers": 1,
            "width": 32,
            "head_width": 16,
            "image_size": 32,
            "patch_size": 8,
            "attentional_pool": True,  # AttentionalPooler: a cross-attention nn.MultiheadAttention (kdim/vdim)
            "attn_pooler_queries": 4,
            "attn_pooler_heads": 2,
        },
        # qk_norm / scale_heads / scale_attn_inner select open_clip's own fused Attention (CustomResidualAttentionBlock)
        text_cfg={
            "context_length": 8,
            "vocab_size": 50,
            "width": 32,
            "heads": 2,
            "layers": 1,
            "qk_norm": True,
            "scale_heads": True,
            "scale_attn_inner": True,
        },
    ).eval()
    with torch.no_grad():
        model.transformer.resblocks[0].attn.head_scale.uniform_(0.5, 2.0)  # ones would hide a missing gain
    image, text = torch.randn(2, 3, 32, 32), torch.randint(0, 50, (2, 8))
    with torch.no_grad():
        img_before, txt_before = model.encode_image(image), model.encode_text(text)
    report = attnlab.swap(model, verify=(image, text))
    assert report.swapped_paths == [
        "visual.transformer.resblocks.0.attn",
        "visual.attn_pool.attn",
        "transformer.resblocks.0.attn",
    ]
    assert [s.to_class for s in report.swapped] == ["attnlab.compat.MultiheadAttention"] * 2 + [
        "attnlab.compat.FusedQKVAttention"
    ]
    with torch.no_grad():
        assert _max_diff(model.encode_image(image), img_before) <= BOUND
        assert _max_diff(model.encode_text(text), txt_before) <= BOUND


def _masks(T: int, S: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(3)
    src_pad = torch.zeros(2, S, dtype=torch.bool)
    src_pad[1, -2:] = True
    tgt_pad = torch.zeros(2, T, dtype=torch.bool)
    tgt_pad[0, -1] = True
    src_mask = torch.rand(S, S, generator=g) > 0.7  # torch's polarity: True = blocked
    src_mask.fill_diagonal_(False)
    return {
        "src_mask": src_mask,
        "tgt_mask": nn.Transformer.generate_square_subsequent_mask(T),
        "src_key_padding_mask": src_pad,
        "tgt_key_padding_mask": tgt_pad,
        "memory_key_padding_mask": src_pad,
    }


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_nn_transformer_with_masks(mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Transformer(
        d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=32, dropout=0.0
    )
    model.train(mode == "train")
    src, tgt = torch.randn(6, 2, 16), torch.randn(5, 2, 16)  # seq-first, torch's default
    kw = {**_masks(5, 6), "tgt_is_causal": True}
    before = model(src, tgt, **kw)
    report = attnlab.swap(model, verify={"src": src, "tgt": tgt, **kw})
    assert report.swapped_paths == [
        "encoder.layers.0.self_attn",
        "decoder.layers.0.self_attn",
        "decoder.layers.0.multihead_attn",
    ]
    assert model.training is (mode == "train")
    after = model(src, tgt, **kw)
    assert _max_diff(after, before) <= BOUND
    if mode == "train":  # the same gradients through every attention
        params = dict(model.named_parameters())
        torch.manual_seed(0)
        ref = nn.Transformer(
            d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=32, dropout=0.0
        )
        ref.load_state_dict(model.state_dict())
        after.square().sum().backward()
        ref(src, tgt, **kw).square().sum().backward()
        for name, p in ref.named_parameters():
            assert _max_diff(params[name].grad, p.grad) <= 1e-4, name


def test_nn_transformer_encoder_nested_tensors_in_eval_no_grad() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    assert enc.use_nested_tensor
    x = torch.randn(3, 5, 16)
    pad = torch.tensor([[0, 0, 0, 0, 0], [0, 0, 0, 1, 1], [0, 0, 0, 0, 1]], dtype=torch.bool)
    with torch.no_grad():
        before = enc(x, src_key_padding_mask=pad)  # torch's nested fast path: zeros at padded positions
    report = attnlab.swap(enc, verify={"src": x, "src_key_padding_mask": pad})
    with torch.no_grad():
        after = enc(x, src_key_padding_mask=pad)
    assert enc.use_nested_tensor and "use_nested_tensor kept True" in report.notes[0]
    assert _max_diff(after, before) <= BOUND


def test_nn_transformer_decoder_layer_tgt_is_causal() -> None:
    torch.manual_seed(0)
    model = nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    tgt, memory = torch.randn(2, 5, 16), torch.randn(2, 4, 16)
    kw = {"tgt_mask": nn.Transformer.generate_square_subsequent_mask(5), "tgt_is_causal": True}
    with torch.no_grad():
        before = model(tgt, memory, **kw)
    report = attnlab.swap(model, verify={"tgt": tgt, "memory": memory, **kw})
    assert report.swapped_paths == ["self_attn", "multihead_attn"]
    with torch.no_grad():
        after = model(tgt, memory, **kw)
    assert _max_diff(after, before) <= BOUND


def test_hugging_face_model_gets_attn_implementation(monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = pytest.importorskip("transformers")
    import attnlab.hf

    attnlab.hf.register()
    mapping = transformers.AttentionInterface._global_mapping
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=40, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 40, (2, 6))
    with monkeypatch.context() as unregistered:  # compat's swap does not import attnlab.hf: it says to register first
        unregistered.delitem(mapping, "attnlab")
        report = attnlab.compat.swap(model)
        assert report.swapped == [] and report.left[0].reason == (
            "attnlab's attention is not registered with transformers yet: call attnlab.hf.register() and swap again "
            "(or load the model with attn_implementation=attnlab.hf.register())"
        )
        assert model.config._attn_implementation == "sdpa"
        with torch.no_grad():
            before = model(input_ids=ids).logits
        report = attnlab.swap(model, verify={"input_ids": ids})  # the package root's swap registers first
        assert "attnlab" in mapping
    assert report.swapped[0].to_class == "attn_implementation='attnlab'"
    assert model.config._attn_implementation == "attnlab"
    with torch.no_grad():
        assert _max_diff(model(input_ids=ids).logits, before) <= BOUND
    assert attnlab.swap(model).left[0].reason == "already attnlab (attn_implementation='attnlab')"


def test_hugging_face_model_whose_attention_is_inline_is_left_with_the_reason() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BloomConfig(hidden_size=16, n_layer=1, n_head=2, vocab_size=40)
    model = transformers.BloomForCausalLM(config).eval()
    before = model.config._attn_implementation
    report = attnlab.swap(model)
    assert report.swapped == [] and report.left[0].reason == (
        "its attention is computed inline (its modeling file never calls an attention function by name), "
        "so attn_implementation='attnlab' would not run attnlab there"
    )
    assert model.config._attn_implementation == before


def test_hugging_face_verify_failure_restores_the_implementation(monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = pytest.importorskip("transformers")
    import attnlab.hf.attention as hf_attention

    hf_attention.register()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=40, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 40, (2, 6))
    real_attend = hf_attention.attend

    def perturbed(*args: object, **kwargs: object) -> tuple[Tensor, Tensor | None, str | None]:
        context, weights, why = real_attend(*args, **kwargs)  # type: ignore[arg-type]
        return context + 1e-2, weights, why

    monkeypatch.setattr(hf_attention, "attend", perturbed)
    with pytest.raises(attnlab.compat.SwapVerificationError, match=r"output\['logits'\] \(float32\) differs after"):
        attnlab.swap(model, verify={"input_ids": ids})
    assert model.config._attn_implementation == "sdpa"
