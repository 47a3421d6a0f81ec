"""The Triton flash-attention forward kernel of triton_correct.py with one mistake: when a key tile raises
the running maximum, the accumulator is not rescaled by exp(m - m_new) (the sum l is). Runs in Triton's
interpreter without a GPU.
"""

from triton_correct import launch  # this folder is on sys.path: check imports a target as `python file.py` would

EXPECTED = "online_softmax_no_rescale"
TARGET = "attention"
LAYOUT = "BHTD"
NEEDS = "triton"


def attention(q, k, v, causal=False, sm_scale=None):
    return launch(q, k, v, causal, sm_scale, rescale=False)  # the mistake: acc is never multiplied by exp(m - m_new)
