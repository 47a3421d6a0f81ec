"""A Triton flash-attention forward kernel behind a Python function, as people write them: (B, H, T, D)
tensors, one program per (query tile, batch * head), an online softmax over key tiles of 16, causal
bottom-right, sm_scale. Without a GPU it runs in Triton's interpreter (TRITON_INTERPRET=1, set here
before triton is imported). The kernel has no backward: check skips the gradient rows.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import triton
import triton.language as tl

EXPECTED = "pass"
TARGET = "attention"
LAYOUT = "BHTD"
FOUND = "causal: causal=True, bottom-right"
NEEDS = "triton"


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, sm_scale, T_q, T_k, CAUSAL: tl.constexpr, RESCALE: tl.constexpr,
                      D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    tile, bh = tl.program_id(0), tl.program_id(1)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + bh * T_q * D + rows[:, None] * D + d[None, :], mask=rows[:, None] < T_q, other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(0, T_k, BLOCK_N):
        n = start + cols
        k = tl.load(k_ptr + bh * T_k * D + n[:, None] * D + d[None, :], mask=n[:, None] < T_k, other=0.0)
        v = tl.load(v_ptr + bh * T_k * D + n[:, None] * D + d[None, :], mask=n[:, None] < T_k, other=0.0)
        s = tl.dot(q, tl.trans(k)) * sm_scale
        visible = n[None, :] < T_k
        if CAUSAL:
            visible = visible & (n[None, :] <= rows[:, None] + T_k - T_q)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - shift[:, None])
        alpha = tl.exp(m - shift)
        if RESCALE:
            acc = acc * alpha[:, None]
        denom = denom * alpha + tl.sum(p, 1)
        acc = acc + tl.dot(p.to(v.dtype), v)
        m = m_new
    out = acc / denom[:, None]
    tl.store(
        o_ptr + bh * T_q * D + rows[:, None] * D + d[None, :], out.to(o_ptr.dtype.element_ty), mask=rows[:, None] < T_q
    )


def launch(q, k, v, causal, sm_scale, rescale):
    """The kernel on (B, H, T, D) tensors; ``rescale=False`` is triton_no_rescale.py's mistake."""
    B, H, T_q, D = q.shape
    T_k = k.shape[2]
    sm_scale = D**-0.5 if sm_scale is None else sm_scale
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty_like(q)
    grid = (triton.cdiv(T_q, 16), B * H)
    _attention_kernel[grid](q, k, v, o, sm_scale, T_q, T_k, CAUSAL=causal, RESCALE=rescale, D=D,
                            BLOCK_M=16, BLOCK_N=16)  # fmt: skip
    return o


def attention(q, k, v, causal=False, sm_scale=None):
    return launch(q, k, v, causal, sm_scale, rescale=True)
