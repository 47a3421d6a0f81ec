"""The checks ``attnlab check`` learned from the peer suites (PyTorch's MHA tests, flash-attention's
``test_flash_attn.py``, Hugging Face's attention tests): each catches a deliberately broken module,
passes the correct ``TinyAttention``, and runs on attnlab (``test_check.py`` runs it there)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attnlab import MultiHeadAttention
from attnlab.check import ModuleAdapter, TorchMHAAdapter, Unsupported, run_checks
from check_factories import TinyAttention

PEER_CHECKS = [
    "parity_head_dims",
    "odd_lengths",
    "low_precision[bf16]",
    "low_precision[fp16]",
    "low_precision_grad[bf16]",
    "low_precision_grad[fp16]",
    "padded_kv_nonfinite",
    "deterministic_backward",
    "dropout_rate",
]


def resizable(cls: type[TinyAttention]) -> ModuleAdapter:
    """A TinyAttention (or broken subclass) that the head-dim check can rebuild: its class is its factory."""
    return ModuleAdapter(cls(), factory=cls)


# -- deliberately broken modules, each a one-method change of a correct TinyAttention ----------
class PowerOfTwoHeadDimScale(TinyAttention):
    def score_scale(self):
        D = self.embed_dim // self.num_heads
        return 1.0 / math.sqrt(2 ** math.ceil(math.log2(D)))  # a kernel's padded head dim: right only for 2^k


class TailBlockDropped(TinyAttention):
    def keep(self, attn_mask, key_padding_mask, is_causal, B, T_q, T_k):
        keep = super().keep(attn_mask, key_padding_mask, is_causal, B, T_q, T_k)
        if T_k > 64:  # a tiled loop over whole blocks of 64 keys: the last T_k % 64 keys never read
            keep = keep & (torch.arange(T_k) < T_k - T_k % 64)
        return keep


class PaddedValuesNotCleared(TinyAttention):
    def clear_padded_values(self, v, key_padding_mask):
        return v  # masked weights are 0, but 0 * NaN = NaN


class _Fp8GradIdentity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(torch.float8_e4m3fn).to(grad.dtype)  # "fp8 is enough for gradients"


class LossyLowPrecisionBackward(TinyAttention):
    def softmax(self, scores, keep):
        weights = super().softmax(scores, keep)
        return _Fp8GradIdentity.apply(weights) if weights.dtype in (torch.bfloat16, torch.float16) else weights


class _AtomicOrderSoftmax(torch.autograd.Function):
    """Softmax whose backward sums over keys in a random order, as atomic adds on a GPU would."""

    @staticmethod
    def forward(ctx, scores):
        weights = torch.softmax(scores, dim=-1)
        ctx.save_for_backward(weights)
        return weights

    @staticmethod
    def backward(ctx, grad):
        (weights,) = ctx.saved_tensors
        gw = grad * weights  # (B, H, T_q, T_k)
        order = torch.randperm(gw.size(-1))
        dot = gw[..., order].sum(-1, keepdim=True)  # (B, H, T_q, 1): float32 sum, in this call's order
        return gw - weights * dot


class NondeterministicBackward(TinyAttention):
    def softmax(self, scores, keep):
        weights = _AtomicOrderSoftmax.apply(scores.masked_fill(~keep, torch.finfo(scores.dtype).min))
        return weights.masked_fill(~keep.any(-1, keepdim=True), 0.0)


class DropoutOffInTraining(TinyAttention):
    def attn_dropout(self, weights):
        return weights  # p is set, train() is called, nothing is dropped


class DropoutKeepProbability(TinyAttention):
    def attn_dropout(self, weights):
        return F.dropout(weights, 1.0 - self.dropout, self.training)  # the keep probability passed as p


class DropoutWithoutRescale(TinyAttention):
    def attn_dropout(self, weights):
        if not self.training:
            return weights
        return weights * (torch.rand_like(weights) >= self.dropout)  # the kept weights lack 1/(1-p)


BROKEN = [
    (PowerOfTwoHeadDimScale, "parity_head_dims"),
    (TailBlockDropped, "odd_lengths"),
    (PaddedValuesNotCleared, "padded_kv_nonfinite"),
    (LossyLowPrecisionBackward, "low_precision_grad[bf16]"),
    (LossyLowPrecisionBackward, "low_precision_grad[fp16]"),
    (NondeterministicBackward, "deterministic_backward"),
    (DropoutOffInTraining, "dropout_rate"),
    (DropoutKeepProbability, "dropout_rate"),
    (DropoutWithoutRescale, "dropout_rate"),
]


@pytest.mark.parametrize(("broken", "check"), BROKEN, ids=[f"{b.__name__}-{c}" for b, c in BROKEN])
def test_broken_module_is_caught_by_its_check(broken, check):
    torch.manual_seed(0)
    bad = run_checks(resizable(broken), checks=[check])[check]
    assert bad.status == "fail" or (bad.status == "note" and bad.hardening), bad  # NaN padded values: a note


@pytest.mark.parametrize("check", PEER_CHECKS)
def test_correct_tiny_attention_passes(check):
    torch.manual_seed(0)
    row = run_checks(resizable(TinyAttention), checks=[check])[check]
    assert row.status == "pass", row


def test_each_broken_module_passes_what_it_does_not_break():
    """The broken modules differ from TinyAttention in one way: the older checks still pass them,
    so each new check finds something the old suite could not."""
    torch.manual_seed(0)
    older = ["parity_self", "parity_cross", "parity_masked", "grad_parity", "padding_invariance", "determinism"]
    older += ["low_precision[bf16]", "dropout_off_in_eval"]
    for broken in {b for b, _ in BROKEN}:
        report = run_checks(resizable(broken), checks=older)
        assert report.ok, (broken.__name__, report.failures)


def test_dropout_rate_reports_what_it_measured():
    torch.manual_seed(0)
    good = run_checks(resizable(TinyAttention), checks=["dropout_rate"])["dropout_rate"]
    assert abs(good.measured - 0.1) < 0.02 and good.tolerance == "0.1 ± 0.023"
    assert "x1.1111, want 1/(1-p) = 1.1111" in good.detail
    off = run_checks(resizable(DropoutOffInTraining), checks=["dropout_rate"])["dropout_rate"]
    assert off.measured == 0.0 and "x1.0000" in off.detail
    swapped = run_checks(resizable(DropoutKeepProbability), checks=["dropout_rate"])["dropout_rate"]
    assert abs(swapped.measured - 0.9) < 0.05
    unscaled = run_checks(resizable(DropoutWithoutRescale), checks=["dropout_rate"])["dropout_rate"]
    assert abs(unscaled.measured - 0.1) < 0.02 and "x1.0000" in unscaled.detail  # right rate, wrong scale


def test_dropout_rate_skips_without_dropout():
    row = run_checks(ModuleAdapter(TinyAttention(dropout=0.0)), checks=["dropout_rate"])["dropout_rate"]
    assert row.status == "skip" and "dropout 0" in row.detail


def test_nondeterministic_backward_has_the_right_gradient():
    """Its gradients are right to rounding: only the bitwise comparison can see the bug."""
    torch.manual_seed(0)
    report = run_checks(resizable(NondeterministicBackward), checks=["grad_parity", "deterministic_backward"])
    assert report["grad_parity"].status == "pass"
    row = report["deterministic_backward"]
    assert row.status == "fail" and 0 < row.measured < 1e-5 and "grads differ" in row.detail


def test_padded_kv_nonfinite_counts_the_poisoned_outputs():
    torch.manual_seed(0)
    row = run_checks(resizable(PaddedValuesNotCleared), checks=["padded_kv_nonfinite"])["padded_kv_nonfinite"]
    assert row.measured == math.inf
    # every output of the 4 + 6 non-pad queries (B=2, T=7), E=16 features, under autograd and no_grad
    assert "nan self: 320 NaN/inf outputs" in row.detail


# -- how a target is rebuilt at another size --------------------------------------------------------
def test_head_dims_skip_a_module_without_factory_with_the_reason():
    row = run_checks(TinyAttention(), checks=["parity_head_dims"])["parity_head_dims"]
    assert row.status == "skip"
    assert "cannot be rebuilt at another size: give its adapter a factory" in row.detail


def test_head_dims_skip_a_factory_without_sizes():
    adapter = ModuleAdapter(TinyAttention(), factory=lambda: TinyAttention())
    row = run_checks(adapter, checks=["parity_head_dims"])["parity_head_dims"]
    assert row.status == "skip" and "factory takes no embed_dim or num_heads" in row.detail


def test_a_factory_that_ignores_the_size_is_refused():
    adapter = ModuleAdapter(TinyAttention(), factory=lambda embed_dim, num_heads: TinyAttention())
    with pytest.raises(Unsupported, match=r"asked for \(E, H, G\) = \(80, 2, 2\) and built \(16, 2, 2\)"):
        adapter.resized(80, 2, 2)


def test_attnlab_module_is_rebuilt_with_its_settings():
    m = MultiHeadAttention(16, 4, num_kv_heads=2, dropout=0.2, bias=False, backend="math")
    built = ModuleAdapter(m).resized(4 * 59, 4, 2)
    assert isinstance(built, ModuleAdapter)
    rebuilt = built.module
    assert isinstance(rebuilt, MultiHeadAttention)
    assert (rebuilt.embed_dim, rebuilt.head_dim, rebuilt.num_kv_heads) == (236, 59, 2)
    assert (rebuilt.dropout, rebuilt.backend, rebuilt.out_proj.bias) == (0.2, "math", None)


def test_torch_mha_is_rebuilt_but_has_no_gqa():
    m = torch.nn.MultiheadAttention(16, 4, dropout=0.1, batch_first=False)
    built = TorchMHAAdapter(m, need_weights=False).resized(4 * 40, 4, 4)
    assert (built.embed_dim, built.module.batch_first, built.need_weights) == (160, False, False)
    with pytest.raises(Unsupported, match="no GQA"):
        TorchMHAAdapter(m).resized(16, 4, 2)


def test_low_precision_names_the_layouts_it_ran():
    torch.manual_seed(0)
    row = run_checks(MultiHeadAttention(16, 4, backend="math"), checks=["low_precision_grad[bf16]"])
    assert "(MHA G=4, GQA G=2, MQA G=1;" in row["low_precision_grad[bf16]"].detail
    tiny = run_checks(resizable(TinyAttention), checks=["low_precision_grad[bf16]"])["low_precision_grad[bf16]"]
    assert "(MHA G=2;" in tiny.detail and "MQA not run (the target's factory takes no num_kv_heads)" in tiny.detail
