"""attnlab.swap: the report, the weights it moves and splits, hooks, modes, verify= and its restore.

Tiny dims throughout (E=16, H=2, T<=6). The per-library models are in tests/test_clients.py.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import attnlab
from attnlab.compat import FusedQKVAttention, MultiheadAttention, SwapReport, SwapVerificationError, swap
from attnlab.compat.swap import Left, Swapped, _compare

timm_attention = pytest.importorskip("timm.layers.attention")
open_clip_transformer = pytest.importorskip("open_clip.transformer")

E, H = 16, 2


def _encoder_layer(**kw: object) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True, **kw))  # type: ignore[arg-type]


def test_exported_names() -> None:
    import inspect

    # attnlab.swap is compat's swap plus attnlab.hf.register() for HF models (tests/test_clients.py)
    assert attnlab.compat.swap is swap and attnlab.SwapReport is SwapReport
    assert inspect.signature(attnlab.swap) == inspect.signature(swap)


def test_report_fields_and_table() -> None:
    model = _encoder_layer()
    report = swap(model)
    assert report.swapped == [
        Swapped("0.self_attn", "torch.nn.MultiheadAttention", "attnlab.compat.MultiheadAttention")
    ]
    assert report.left == [] and report.notes == [] and report.verified is None
    assert report.swapped_paths == ["0.self_attn"]
    assert str(report) == (
        "attnlab.swap: 1 replaced, 0 left\n"
        "  replaced     from                         to\n"
        "  0.self_attn  torch.nn.MultiheadAttention  attnlab.compat.MultiheadAttention"
    )
    assert type(model[0].self_attn) is MultiheadAttention


def test_mha_keeps_parameter_objects_state_dict_and_outputs() -> None:
    model = _encoder_layer()
    old = model[0].self_attn
    params = dict(old.named_parameters())
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 5, E)
    before = model(x)
    swap(model)
    new = model[0].self_attn
    assert {k: id(v) for k, v in new.named_parameters()} == {k: id(v) for k, v in params.items()}
    assert new.out_proj is old.out_proj
    assert sd.keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        assert torch.equal(v, sd[k]), k
    assert (model(x) - before).abs().max() <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_dtype_training_and_requires_grad_preserved(dtype: torch.dtype) -> None:
    model = _encoder_layer().to(dtype)
    model[0].self_attn.in_proj_weight.requires_grad_(False)
    model[0].self_attn.train(False)  # a mode that differs from its parent's: kept as it is
    timm_block = nn.Sequential(timm_attention.Attention(E, H, qkv_bias=True).to(dtype))
    timm_block[0].qkv.weight.requires_grad_(False)
    timm_block.train(True)
    swap(model)
    swap(timm_block)
    mha, fused = model[0].self_attn, timm_block[0]
    assert isinstance(fused, FusedQKVAttention)
    assert mha.training is False and model[0].training is True
    assert mha.in_proj_weight.requires_grad is False and mha.out_proj.weight.requires_grad is True
    assert fused.training is True and fused.q_proj.training is True
    for p in (fused.q_proj, fused.k_proj, fused.v_proj):
        assert p.weight.dtype == dtype and p.weight.device.type == "cpu" and p.weight.requires_grad is False
        assert p.bias.requires_grad is True
    assert all(p.device.type == "cpu" for p in fused.parameters())  # nothing left on the meta device


def test_timm_weights_split_and_modules_moved() -> None:
    torch.manual_seed(0)
    m = timm_attention.Attention(E, H, qkv_bias=True, qk_norm=True, scale_norm=True, norm_layer=nn.LayerNorm)
    with torch.no_grad():  # non-trivial norms, so that moving them matters
        for norm in (m.q_norm, m.k_norm, m.norm):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
    ours = FusedQKVAttention.from_timm(m)
    W, b = m.qkv.weight, m.qkv.bias  # (3E, E), (3E,)
    for i, proj in enumerate((ours.q_proj, ours.k_proj, ours.v_proj)):
        assert type(proj) is nn.Linear
        assert torch.equal(proj.weight, W[i * E : (i + 1) * E]) and torch.equal(proj.bias, b[i * E : (i + 1) * E])
        assert proj.weight.untyped_storage().data_ptr() != W.untyped_storage().data_ptr()  # a copy, not a view
    assert ours.out_proj is m.proj and ours.q_norm is m.q_norm and ours.k_norm is m.k_norm and ours.inner_norm is m.norm
    x = torch.randn(2, 5, E)
    assert (ours(x) - m(x)).abs().max() <= 1e-6


@pytest.mark.parametrize(
    "mask_kind", ["none", "bool_2d", "float_2d", "bool_4d_batch", "bool_3d_heads", "causal"], ids=lambda s: s
)
def test_timm_masks_match(mask_kind: str) -> None:
    torch.manual_seed(0)
    m = timm_attention.Attention(E, H, qkv_bias=True).eval()
    ours = FusedQKVAttention.from_timm(m)
    x = torch.randn(2, 5, E)
    keep = torch.rand(5, 5) > 0.4
    keep.fill_diagonal_(True)
    kwargs: dict[str, object] = {
        "none": {},
        "bool_2d": {"attn_mask": keep},
        "float_2d": {"attn_mask": torch.zeros(5, 5).masked_fill(~keep, float("-inf")) + 0.3 * torch.randn(5, 5)},
        "bool_4d_batch": {"attn_mask": torch.stack([keep, keep.T])[:, None]},  # (B, 1, T, T)
        "bool_3d_heads": {"attn_mask": torch.stack([keep, keep.T])},  # (H, T, T): SDPA broadcasts it over heads
        "causal": {"is_causal": True},
    }[mask_kind]
    assert (ours(x, **kwargs) - m(x, **kwargs)).abs().max() <= 1e-6


def test_timm_mask_and_causal_together_refused() -> None:
    ours = FusedQKVAttention.from_timm(timm_attention.Attention(E, H))
    with pytest.raises(ValueError, match=r"^attn_mask and is_causal=True were both given; timm's two paths disagree"):
        ours(torch.randn(1, 3, E), attn_mask=torch.ones(3, 3, dtype=torch.bool), is_causal=True)


@pytest.mark.parametrize("mask_kind", ["bool_2d", "bool_3d", "float_2d"])
def test_open_clip_block_polarity_and_options(mask_kind: str) -> None:
    torch.manual_seed(0)
    m = open_clip_transformer.Attention(E, H, qk_norm=True, scale_heads=True, inner_norm=True).eval()
    with torch.no_grad():
        m.head_scale.uniform_(0.5, 2.0)  # ones would hide a head_scale that is not applied
        m.ln_q.weight.uniform_(0.5, 1.5)
    ours = FusedQKVAttention.from_open_clip(m)
    assert ours.head_scale is m.head_scale and ours.inner_norm is m.ln_inner
    x = torch.randn(2, 5, E)
    blocked = torch.rand(5, 5) > 0.6  # open_clip's bool polarity: True = blocked
    blocked.fill_diagonal_(False)
    mask = {
        "bool_2d": blocked,
        "bool_3d": torch.stack([blocked, blocked.T, blocked, blocked.T]),  # (B*H, T, T)
        "float_2d": torch.zeros(5, 5).masked_fill(blocked, float("-inf")),
    }[mask_kind]
    assert (ours(x, attn_mask=mask) - m(x, attn_mask=mask)).abs().max() <= 1e-6


def test_double_swap_reports_already_attnlab() -> None:
    model = nn.Sequential(_encoder_layer(), nn.Sequential(timm_attention.Attention(E, H)))
    first = swap(model)
    assert len(first.swapped) == 2
    second = swap(model)
    assert second.swapped == []
    assert second.left == [
        Left("0.0.self_attn", "attnlab.compat.MultiheadAttention", "already attnlab"),
        Left("1.0", "attnlab.compat.FusedQKVAttention", "already attnlab"),
    ]


def test_forward_hooks_moved_and_still_removable() -> None:
    model = _encoder_layer()
    calls: list[tuple[int, ...]] = []
    handle = model[0].self_attn.register_forward_hook(lambda mod, args, out: calls.append(tuple(out[0].shape)))
    pre = model[0].self_attn.register_forward_pre_hook(lambda mod, args: None)
    report = swap(model)
    assert report.swapped[0].note == "2 hooks moved"
    assert str(report).endswith("attnlab.compat.MultiheadAttention (2 hooks moved)")
    model(torch.randn(2, 3, E))
    assert calls == [(2, 3, E)]
    handle.remove()
    pre.remove()
    model(torch.randn(2, 3, E))
    assert calls == [(2, 3, E)] and not model[0].self_attn._forward_hooks


def test_hook_on_fused_qkv_is_left_with_reason() -> None:
    model = nn.Sequential(timm_attention.Attention(E, H))
    model[0].qkv.register_forward_hook(lambda *a: None)
    report = swap(model)
    assert report.swapped == []
    assert report.left == [
        Left(
            "0",
            "timm.layers.Attention",
            "a hook is registered on its qkv Linear, which the swap would split into q/k/v_proj",
        )
    ]
    assert type(model[0]) is timm_attention.Attention


def test_unrecognised_and_unexpressible_modules_are_left_with_reasons() -> None:
    class MyAttention(nn.Module):  # by its name
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(E, E)

    class Mixer(nn.Module):  # by its projections
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(E, 3 * E)

    class AttentionBlock(nn.Module):  # an "Attention" container around something swap knows: not reported
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(E, H)

    class MyMHA(nn.MultiheadAttention):
        pass

    cosine = open_clip_transformer.Attention(E, H, scaled_cosine=True)
    model = nn.ModuleDict({"a": MyAttention(), "b": Mixer(), "c": AttentionBlock(), "d": MyMHA(E, H), "e": cosine})
    report = swap(model)
    assert report.swapped_paths == ["c.attn"]
    unknown = "an attention-like module attnlab.swap does not know (by its class name or q/k/v projections)"
    by_path = {x.path: x.reason for x in report.left}
    assert by_path["a"] == unknown and by_path["b"] == unknown
    assert by_path["d"].startswith("a subclass of nn.MultiheadAttention (MyMHA: parametrized, quantized or with its")
    assert by_path["e"].startswith("open_clip Attention with scaled_cosine=True: its own forward calls torch.bmm")
    assert set(by_path) == {"a", "b", "d", "e"}


def test_known_timm_classes_are_left_with_their_own_reason() -> None:
    from timm.layers.attention2d import Attention2d
    from timm.layers.diff_attention import DiffAttention

    report = swap(nn.ModuleDict({"conv": Attention2d(E, num_heads=H), "diff": DiffAttention(E, num_heads=H)}))
    assert report.left == [
        Left(
            "conv",
            "timm.layers.Attention2d",
            "attention over NCHW feature maps with 1x1-conv projections; attnlab's modules take (B, T, C) tokens",
        ),
        Left(
            "diff",
            "timm.layers.DiffAttention",
            "differential attention (the difference of two softmaxes) has no attnlab module",
        ),
    ]


def test_exclude() -> None:
    model = nn.Sequential(_encoder_layer(), _encoder_layer())
    report = swap(model, exclude=["1.0.self_attn"])
    assert report.swapped_paths == ["0.0.self_attn"]
    assert report.left == [Left("1.0.self_attn", "torch.nn.MultiheadAttention", "excluded by exclude=")]
    with pytest.raises(ValueError, match=r"^exclude names \['nope'\], which are not module paths of this model"):
        swap(nn.Sequential(_encoder_layer()), exclude=["nope"])


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match=r"^model must be a torch.nn.Module, got dict; pass the model object itself"):
        swap({"a": 1})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^backend must be one of 'auto', 'math' or 'sdpa', got 'fast'"):
        swap(_encoder_layer(), backend="fast")  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"^exclude must be a collection of module paths, got the str '0'; pass \['0'\]"
    ):
        swap(_encoder_layer(), exclude="0")
    with pytest.raises(TypeError, match=r"^verify must be a sample input: a tensor \(model\(x\)\), a tuple"):
        swap(_encoder_layer(), verify=[torch.randn(1, 2, E)])  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"^model is itself a torch.nn.MultiheadAttention; swap replaces modules inside"
    ):
        swap(nn.MultiheadAttention(E, H))


def test_verify_passes_and_reports_errors() -> None:
    model = nn.Sequential(nn.Sequential(timm_attention.Attention(E, H, qkv_bias=True)), _encoder_layer())
    report = swap(model, verify=torch.randn(2, 5, E))
    assert report.verified is not None and len(report.verified) == 1
    v = report.verified[0]
    assert v.output == "output" and v.dtype == torch.float32 and v.max_error <= v.allowed
    assert re.search(r"verified output \(float32\): max error \S+ <= allowed \S+$", str(report))


def test_verify_failure_restores_the_original_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Sequential(_encoder_layer(), nn.Sequential(timm_attention.Attention(E, H)))
    originals = [model[0][0].self_attn, model[1][0]]
    x = torch.randn(2, 5, E)
    before = model(x)
    real_forward = FusedQKVAttention.forward

    def perturbed(self: FusedQKVAttention, *args: object, **kwargs: object) -> torch.Tensor:
        return real_forward(self, *args, **kwargs) + 1e-3  # type: ignore[arg-type]

    monkeypatch.setattr(FusedQKVAttention, "forward", perturbed)
    with pytest.raises(SwapVerificationError) as info:
        swap(model, verify=x)
    msg = str(info.value)
    assert re.match(
        r"attnlab.swap\(verify=...\): output \(float32\) differs after the swap by 1\.0\d\de-03 from a float64 copy "
        r"of the original model; allowed \S+ \(2 x the original's own error \S+ \+ atol 1e-05 x max\(1, max "
        r"\|reference\|\)\)\. Swapped: 0\.0\.self_attn, 1\.0\. The model was restored: every original module is "
        r"back in place and nothing else was changed\.$",
        msg,
    ), msg
    assert info.value.failed.max_error > info.value.failed.allowed
    assert [model[0][0].self_attn, model[1][0]] == originals
    assert torch.equal(model(x), before)


def test_verify_when_a_model_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _encoder_layer()
    with pytest.raises(
        ValueError, match=r"^verify=: the model itself, before any swap, raised RuntimeError on the sample"
    ):
        swap(model, verify=torch.randn(2, 5, E + 1))
    assert type(model[0].self_attn) is nn.MultiheadAttention

    def refuses(self: MultiheadAttention, *args: object, **kwargs: object) -> None:
        raise ValueError("no")

    monkeypatch.setattr(MultiheadAttention, "forward", refuses)
    with pytest.raises(
        SwapVerificationError,
        match=r"^attnlab.swap\(verify=...\): the swapped model raised ValueError on the sample the original ran \(no\)\. "
        r"Swapped: 0.self_attn\. The model was restored",
    ):
        swap(model, verify=torch.randn(2, 5, E))
    assert type(model[0].self_attn) is nn.MultiheadAttention


def test_verify_runs_in_eval_and_restores_training_flags() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.TransformerEncoderLayer(E, H, 32, dropout=0.5, batch_first=True))
    model.train()
    model[0].dropout1.eval()  # a mixed state must come back as it was
    report = swap(model, verify=torch.randn(2, 4, E))
    assert report.verified and report.verified[0].max_error <= report.verified[0].allowed
    assert model.training and model[0].self_attn.training and not model[0].dropout1.training
    assert report.notes == ["verify ran the model in eval mode under no_grad; its training flags are as they were"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_verify_in_low_precision(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(timm_attention.Attention(E, H, qkv_bias=True)), _encoder_layer()).to(dtype)
    report = swap(model, verify=torch.randn(2, 5, E, dtype=dtype))
    assert report.verified is not None and report.verified[0].dtype == dtype
    v = report.verified[0]
    assert v.original_error > 0 and v.max_error <= v.allowed  # the rule had a low-precision error to scale


def test_nested_encoder_flag_is_kept_and_reported() -> None:
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True), 1)
    assert enc.use_nested_tensor
    report = swap(nn.Sequential(enc))
    assert enc.use_nested_tensor
    assert report.notes[0].startswith("0.use_nested_tensor kept True: attnlab.compat.MultiheadAttention takes")


def test_a_shared_module_gets_one_shared_replacement() -> None:
    layer = nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True)
    timm_attn = timm_attention.Attention(E, H)
    model = nn.ModuleDict({"a": layer, "b": layer, "c": nn.Sequential(timm_attn), "d": nn.Sequential(timm_attn)})
    report = swap(model)
    assert model["a"].self_attn is model["b"].self_attn and model["c"][0] is model["d"][0]
    assert [(s.path, s.note) for s in report.swapped] == [
        ("a.self_attn", ""),
        ("c.0", ""),
        ("d.0", "the same module as c.0"),
    ]
    assert report.left == []  # b, the same layer as a, is walked once


@pytest.mark.parametrize("source", ["timm", "open_clip"])
def test_the_source_checkpoint_loads_after_the_swap(source: str) -> None:
    torch.manual_seed(0)
    if source == "timm":
        m = timm_attention.Attention(E, H, qkv_bias=True, qk_norm=True, scale_norm=True, norm_layer=nn.LayerNorm)
    else:
        m = open_clip_transformer.Attention(E, H, qk_norm=True, scale_heads=True, inner_norm=True)
    model = nn.Sequential(m).eval()
    checkpoint = {k: torch.randn_like(v) for k, v in model.state_dict().items()}  # not the weights it holds
    model.load_state_dict(checkpoint)
    x = torch.randn(2, 5, E)
    expected = model(x)
    swap(model)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert model.load_state_dict(checkpoint).missing_keys == []
    # the weights are randn, not an init: outputs reach ~10, so float32's rounding is measured against their size
    # (timm's order of summation differs from SDPA's; 1.31e-6 of an output near 10 on an AMD EPYC Zen 4)
    assert (model(x) - expected).abs().max() <= 1e-6 * max(1.0, expected.abs().max().item())


def test_a_changed_scale_is_left_with_reason() -> None:
    m = timm_attention.Attention(E, H)
    m.scale = 0.5
    report = swap(nn.Sequential(m))
    assert report.left == [
        Left(
            "0",
            "timm.layers.Attention",
            "Attention.scale is 0.5, not head_dim ** -0.5 = 0.353553; its SDPA path ignores scale and its manual "
            "path uses it, so the module has no one output to match",
        )
    ]


class _Masked(nn.Module):
    """A model whose forward takes the mask on to its attention."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = timm_attention.Attention(E, H, qkv_bias=True)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.attn(x, attn_mask=attn_mask)
        return out


def test_verify_on_fully_masked_rows() -> None:
    """torch's fused float32 kernel gives a fully masked query a finite output, its float64 math path NaN:
    the original stands in for the reference there, and attnlab's output (the bias alone) must match it."""
    torch.manual_seed(0)
    model = _Masked()
    x = torch.randn(1, 4, E)
    keep = torch.ones(4, 4, dtype=torch.bool)
    keep[2] = False  # query 2 may attend to nothing
    with torch.no_grad():
        before = model(x, keep)
    report = swap(model, verify=(x, keep))
    v = report.verified[0] if report.verified else None
    assert v is not None and v.not_compared == 0 and v.max_error <= v.allowed
    with torch.no_grad():
        after = model(x, keep)
    assert torch.equal(after[0, 2], model.attn.out_proj.bias)  # zero context: the bias alone
    assert (after - before).abs().max() <= 1e-6


def test_verify_does_not_compare_where_the_original_is_nan() -> None:
    original = torch.tensor([1.0, float("nan")])
    v = _compare("output", original, original.double(), torch.tensor([1.0, 0.0]))
    assert (v.not_compared, v.max_error) == (1, 0.0)
    v = _compare("output", original, original.double(), torch.tensor([float("nan"), 0.0]))
    assert v.max_error == float("inf") and not v.max_error <= v.allowed  # NaN where the reference is finite
