"""Every pitfall of seed 002's error table gets one clear sentence, asserted word for word."""

from __future__ import annotations

import re

import pytest
import torch

from attnlab import MultiHeadAttention


def raises(exc, message):
    return pytest.raises(exc, match="^" + re.escape(message) + "$")


@pytest.fixture
def mha():
    return MultiHeadAttention(16, 4)


# 1. divisibility ---------------------------------------------------------------------------
def test_embed_dim_not_divisible_by_heads():
    with raises(
        ValueError,
        "embed_dim=64 is not divisible by num_heads=6: every head gets embed_dim // num_heads "
        "dims; choose num_heads among the divisors of 64 (nearest: [4, 8]) or change embed_dim to a multiple of 6.",
    ):
        MultiHeadAttention(64, 6)


def test_heads_not_divisible_by_kv_heads():
    with raises(
        ValueError,
        "num_heads=8 is not divisible by num_kv_heads=3: each K/V head serves an equal group "
        "of query heads; choose num_kv_heads among [1, 2, 4, 8].",
    ):
        MultiHeadAttention(64, 8, num_kv_heads=3)


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"embed_dim": 0}, "embed_dim must be a positive int, got 0 (int)."),
        ({"num_heads": 2.0}, "num_heads must be a positive int, got 2.0 (float)."),
        ({"dropout": 1.0}, "dropout must be in [0, 1), got 1.0; it is the probability of zeroing a weight."),
        ({"scale": -1.0}, "scale must be a positive float (default 1/sqrt(head_dim)), got -1.0."),
        ({"backend": "flash"}, "backend must be one of ('auto', 'math', 'sdpa', 'flex'), got 'flash'."),
    ],
)
def test_constructor_arguments(kw, message):
    args = {"embed_dim": 16, "num_heads": 4} | kw
    with raises((ValueError, TypeError), message):
        MultiHeadAttention(args.pop("embed_dim"), args.pop("num_heads"), **args)


# 2. input shapes ---------------------------------------------------------------------------
def test_unbatched_input_says_add_batch_dim(mha):
    with raises(
        ValueError,
        "query has shape (10, 16), an unbatched (T, embed_dim) input; attnlab is batch-first "
        "and expects (B, T, embed_dim): add a batch dimension with query.unsqueeze(0).",
    ):
        mha(torch.randn(10, 16))


def test_four_d_input(mha):
    with raises(ValueError, "query has shape (2, 4, 10, 16); expected 3-D (B, T, embed_dim=16)."):
        mha(torch.randn(2, 4, 10, 16))


def test_wrong_width(mha):
    with raises(ValueError, "query has last dimension 12 (shape (2, 5, 12)); expected embed_dim=16."):
        mha(torch.randn(2, 5, 12))
    with raises(
        ValueError,
        "key has last dimension 12 (shape (2, 5, 12)); expected kdim=16 (use kdim/vdim for a "
        "context of another width).",
    ):
        mha(torch.randn(2, 5, 16), torch.randn(2, 5, 12))


def test_batch_mismatch(mha):
    with raises(
        ValueError,
        "key has batch size 3 but query has 2; query (B, T_q, E) and key (B, T_k, kdim) must "
        "share B (for one shared context, use key.expand(2, -1, -1)).",
    ):
        mha(torch.randn(2, 5, 16), torch.randn(3, 5, 16))


def test_key_value_length_mismatch(mha):
    with raises(ValueError, "value has (B, T_k) = (2, 6) but key has (2, 5); every key needs exactly one value."):
        mha(torch.randn(2, 5, 16), torch.randn(2, 5, 16), torch.randn(2, 6, 16))


def test_integer_input_is_not_embeddings(mha):
    with raises(
        TypeError,
        "query has dtype torch.int64; expected a floating tensor (B, T, embed_dim=16). Token ids "
        "go through an nn.Embedding first.",
    ):
        mha(torch.randint(0, 10, (2, 5, 16)))


def test_not_a_tensor(mha):
    with raises(TypeError, "query must be a torch.Tensor of shape (B, T, embed_dim=16), got list."):
        mha([[1.0] * 16])


# 3. devices and dtypes ---------------------------------------------------------------------
def test_device_mismatch_input_vs_weights(mha):
    x = torch.randn(2, 5, 16, device="meta")
    with raises(
        ValueError,
        "query is on meta but the module's weights are on cpu; move one of them: query.to('cpu') or mha.to('meta').",
    ):
        mha(x)


def test_device_mismatch_mask_vs_query(mha):
    with raises(ValueError, "attn_mask is on meta but the query is on cpu; move it with attn_mask.to('cpu')."):
        mha(torch.randn(2, 5, 16), attn_mask=torch.ones(5, 5, dtype=torch.bool, device="meta"))
    with raises(
        ValueError, "key_padding_mask is on meta but the query is on cpu; move it with key_padding_mask.to('cpu')."
    ):
        mha(torch.randn(2, 5, 16), key_padding_mask=torch.zeros(2, 5, dtype=torch.bool, device="meta"))


def test_dtype_mismatch(mha):
    with raises(
        TypeError,
        "query has dtype torch.float64 but the module's weights are torch.float32; cast one of "
        "them (query.to(torch.float32) or mha.to(torch.float64)), or run under torch.autocast.",
    ):
        mha(torch.randn(2, 5, 16, dtype=torch.float64))


# 4. mask dtypes ----------------------------------------------------------------------------
def test_integer_mask(mha):
    with raises(
        TypeError,
        "attn_mask has dtype torch.int64; expected torch.bool (True = may attend) or a float "
        "dtype (added to the scores). For a 0/1 integer mask pass attn_mask.bool().",
    ):
        mha(torch.randn(2, 5, 16), attn_mask=torch.ones(5, 5, dtype=torch.long).tril())


def test_float_zero_one_mask_is_refused(mha):
    """Seed 000's 0/1 mask passed as float would be *added* to the scores and mask nothing."""
    with raises(
        ValueError,
        "attn_mask is a float tensor holding only 0s and 1s; a float mask is *added* to the "
        "scores, so this masks nothing and only shifts some scores by 1. For a keep/block mask pass "
        "attn_mask.bool() (True = may attend); for an additive mask use 0 to keep and float('-inf') to "
        "block, e.g. torch.zeros_like(m).masked_fill(m == 0, float('-inf')).",
    ):
        mha(torch.randn(2, 5, 16), attn_mask=torch.ones(5, 5).tril())


def test_float_additive_mask_with_zeros_and_minus_inf_is_fine(mha):
    m = torch.zeros(5, 5).masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    x = torch.randn(2, 5, 16)
    assert torch.allclose(mha(x, attn_mask=m), mha(x, is_causal=True), atol=1e-6)
    assert mha(x, attn_mask=torch.zeros(5, 5)).shape == (2, 5, 16)  # all zeros: no masking, allowed


def test_key_padding_mask_dtype_and_shape(mha):
    x = torch.randn(2, 5, 16)
    with raises(
        TypeError,
        "key_padding_mask has dtype torch.int64; expected torch.bool with True = padding. For a "
        "0/1 mask where 1 marks padding pass key_padding_mask.bool(); for an attention mask where 1 marks "
        "real tokens pass attention_mask == 0.",
    ):
        mha(x, key_padding_mask=torch.zeros(2, 5, dtype=torch.long))
    with raises(
        ValueError,
        "key_padding_mask has shape (5,); expected (B, T_k) = (2, 5), one flag per key position with True = padding.",
    ):
        mha(x, key_padding_mask=torch.zeros(5, dtype=torch.bool))


# 5. mask shapes ----------------------------------------------------------------------------
def test_mask_that_does_not_broadcast(mha):
    with raises(
        ValueError,
        "attn_mask has shape (5, 6), which does not broadcast to the scores' (B, H, T_q, T_k) "
        "= (2, 4, 5, 5); pass (T_q, T_k) = (5, 5), (B, T_q, T_k) = (2, 5, 5), or a 4-D mask whose every "
        "dim is 1 or the one in (2, 4, 5, 5) (a mask of shape (B*H, T_q, T_k) must be viewed as "
        "(B, H, T_q, T_k)).",
    ):
        mha(torch.randn(2, 5, 16), attn_mask=torch.ones(5, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attn_mask has shape \(8, 5, 5\), which does not broadcast"):
        mha(torch.randn(2, 5, 16), attn_mask=torch.ones(8, 5, 5, dtype=torch.bool))  # torch's (B*H, T, T)


# 6. impossible combinations ----------------------------------------------------------------
def test_causal_with_more_queries_than_keys(mha):
    with raises(
        ValueError,
        "is_causal=True needs T_q <= T_k, got T_q=6 queries and T_k=4 keys: causal masking "
        "aligns the last query with the last key, so the first 2 queries would see no key at all. Pass an "
        "explicit attn_mask instead.",
    ):
        mha(torch.randn(2, 6, 16), torch.randn(2, 4, 16), is_causal=True)


def test_need_weights_on_sdpa(mha):
    mha.backend = "sdpa"
    with raises(
        ValueError,
        "need_weights=True with backend='sdpa': SDPA never materialises the attention weights; "
        "set mha.backend = 'auto' or 'math' for this call.",
    ):
        mha(torch.randn(2, 5, 16), need_weights=True)


# The seed's "view on a non-contiguous tensor" failure is unreachable -----------------------
@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_no_input_layout_reaches_a_view_error(backend, kv_heads):
    mha = MultiHeadAttention(16, 4, num_kv_heads=kv_heads, backend=backend)
    x = torch.randn(16, 6, 2).permute(2, 1, 0)  # (2, 6, 16), last dim strided
    ctx = torch.randn(1, 9, 16).expand(2, 9, 16)  # stride 0 over batch
    keep = torch.ones(9, 6, dtype=torch.bool).T  # (6, 9) transposed view
    pad = torch.zeros(9, 2, dtype=torch.bool).T  # (2, 9) transposed view
    keep4 = torch.ones(1, 1, 6, 9, dtype=torch.bool).expand(2, 4, 6, 9)  # broadcast view
    for args, kw in [
        ((x,), {}),
        ((x, ctx), {"attn_mask": keep, "key_padding_mask": pad}),
        ((x, ctx), {"attn_mask": keep4, "is_causal": True}),
        ((x[:, ::2],), {"is_causal": True}),
    ]:
        out = mha(*args, **kw)
        ref = mha(
            *(a.contiguous() for a in args), **{k: (v.contiguous() if torch.is_tensor(v) else v) for k, v in kw.items()}
        )
        assert torch.allclose(out, ref, atol=1e-6)


# -- the torch release ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("version", ["2.10.1+cu128", "2.5.0", "1.13.1"])
def test_a_torch_older_than_the_floor_is_refused_at_import_in_one_sentence(version, monkeypatch):
    """``import attnlab`` checks torch's version before anything else; an older torch gets one ImportError naming
    the installed version, the floor, what was tested and the command that fixes it (not a traceback from a
    compiled graph, as torch 2.11's dynamo gave for a slice before attnlab stopped passing them)."""
    from attnlab.runtime import torch_version

    monkeypatch.setattr(torch, "__version__", version)
    with pytest.raises(ImportError) as err:
        torch_version.check_torch_version()
    assert str(err.value) == (
        f"attnlab needs torch >= 2.11 (tested on 2.11 (CUDA 13.0, H200) and 2.13 (CPU)), but this environment has "
        f"torch {version}; upgrade it with pip install -U 'torch>=2.11' (for a CUDA build, the command from "
        f"pytorch.org for your CUDA version)."
    )


def test_import_attnlab_with_an_old_torch_ends_in_that_one_sentence():
    """The package import itself, in a fresh interpreter whose torch claims 2.10: the ImportError is the
    first thing ``import attnlab`` does, before any submodule runs."""
    import subprocess
    import sys

    code = "import torch; torch.__version__ = '2.10.0'; import attnlab"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert (
        run.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "ImportError: attnlab needs torch >= 2.11 (tested on 2.11 (CUDA 13.0, H200) and 2.13 (CPU)), but this "
            "environment has torch 2.10.0;"
        )
    )


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.13.0", "2.12.0a0+git1234", "3.0.0", "custom-build"])
def test_supported_and_unreadable_torch_versions_pass(version):
    from attnlab.runtime.torch_version import torch_version_problem

    assert torch_version_problem(version) is None


def test_the_floor_is_the_one_pyproject_declares():
    """pip and the import check hold one floor: pyproject's torch requirement is MIN_TORCH."""
    from pathlib import Path

    from attnlab.runtime.torch_version import MIN_TORCH

    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    dependencies = pyproject.split("dependencies = [", 1)[1].split("]", 1)[0]  # [project]'s list (3.10: no tomllib)
    assert re.findall(r'"torch([<>=!~][^"]*)"', dependencies) == [f">={MIN_TORCH[0]}.{MIN_TORCH[1]}"]
