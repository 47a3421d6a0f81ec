"""Ground truth for tests/style_corpus/: each correct module is plain attention, each mistake visibly is not.

Every corpus file is built at E=32, H=4 (G=2 K/V heads for Llama), float64, eval mode, dropout 0, and called through
a small driver per style that knows the style's call form and mask convention. A plain float64 reference,
softmax(Q K^T / sqrt(D) + mask) V with the module's own projection weights (K/V heads repeat_interleave'd for GQA),
must match a correct module to 1e-10 on every input, and miss a mistake module by more than 1e-3 on at least one.

Notation: B batch, T_q / T_k query / key length, E width, H heads, G K/V heads, D = E // H head width.
"""

from __future__ import annotations

import ast
import importlib.util
import math
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from attnlab.check.catalogue import MISTAKES

CORPUS = Path(__file__).parent / "style_corpus"
FILES = sorted(CORPUS.glob("*.py"))
STYLES = ("annotated", "d2l", "nanogpt", "bert", "torchwrap", "llama")
NEW_IDS = {"rows_misassigned", "batch_seq_swapped", "qkv_split_order", "padding_mask_added"}
B, E, H, G, T, T_Q = 2, 32, 4, 2, 7, 6
LENGTHS = (4, 7)  # real keys per sequence; every query keeps at least one key
EXACT, VISIBLE = 1e-10, 1e-3

# tiny tensors: one thread, so that OpenMP does not spin against other processes on a shared machine
pytestmark = pytest.mark.usefixtures("one_thread")


def load(path: Path):
    spec = importlib.util.spec_from_file_location(f"style_corpus_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def declared(path: Path) -> dict[str, str]:
    """The module-level string constants of a corpus file, read from its source."""
    out = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                out[node.targets[0].id] = node.value.value
    return out


# ----------------------------------------------------------------------------- reference


def reference(xq, xk, xv, w, keep=None):
    """softmax(Q K^T / sqrt(D), masked where keep is False) V, then the output projection.

    xq (B, T_q, E), xk/xv (B, T_k, E); w = (Wq, bq, Wk, bk, Wv, bv, Wo, bo, H, G); keep bool broadcastable to
    (B, H, T_q, T_k), True = may attend."""
    Wq, bq, Wk, bk, Wv, bv, Wo, bo, h, g = w
    b, t_q, _ = xq.shape
    t_k = xk.shape[1]
    d = Wq.shape[0] // h
    q = F.linear(xq, Wq, bq).view(b, t_q, h, d).transpose(1, 2)  # (B, H, T_q, D)
    k = F.linear(xk, Wk, bk).view(b, t_k, g, d).transpose(1, 2).repeat_interleave(h // g, dim=1)  # (B, H, T_k, D)
    v = F.linear(xv, Wv, bv).view(b, t_k, g, d).transpose(1, 2).repeat_interleave(h // g, dim=1)  # (B, H, T_k, D)
    scores = q @ k.transpose(-2, -1) / math.sqrt(d)  # (B, H, T_q, T_k)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v  # (B, H, T_q, D)
    return F.linear(out.transpose(1, 2).reshape(b, t_q, h * d), Wo, bo)  # (B, T_q, E)


def lin(layer):
    return layer.weight, layer.bias


# ----------------------------------------------------------------------------- inputs and masks


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, E, generator=g, dtype=torch.float64)
    q = torch.randn(B, T_Q, E, generator=g, dtype=torch.float64)
    k = torch.randn(B, T, E, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, E, generator=g, dtype=torch.float64)
    return x, q, k, v


def pad_keep(t=T):
    """(B, T) bool, True = a real key."""
    return torch.arange(t)[None, :] < torch.tensor(LENGTHS)[:, None]


def causal_keep(t=T):
    """(T, T) bool, True where key j <= query i."""
    return torch.ones(t, t, dtype=torch.bool).tril()


def additive(keep, dtype=torch.float64, fill=None):
    """A bool keep-mask as an additive float mask: 0 to keep, fill (default finfo.min) to hide."""
    fill = torch.finfo(dtype).min if fill is None else fill
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, fill)


def first(out):
    return out[0] if isinstance(out, tuple) else out


# ----------------------------------------------------------------------------- per-style drivers
# Each driver: build(cls) -> module in float64 eval; weights(m) -> reference weights;
# cases(m) -> [(label, call() -> output, reference output)].


def build_annotated(cls):
    m = cls(H, E, dropout=0.0)
    # clones() deep-copies one Linear, so all four start equal; the Annotated Transformer's make_model then redraws
    # every matrix (xavier_uniform_). Do the same, biases too, or a q/k/v mix-up would be invisible here.
    with torch.no_grad():
        for layer in m.linears:
            torch.nn.init.xavier_uniform_(layer.weight)
            torch.nn.init.normal_(layer.bias, std=0.1)
    return m


def weights_annotated(m):
    return (*lin(m.linears[0]), *lin(m.linears[1]), *lin(m.linears[2]), *lin(m.linears[3]), H, H)


def cases_annotated(m, w):
    x, q, k, v = inputs()
    pad = pad_keep()
    both = causal_keep()[None] & pad[:, None, :]  # (B, T, T)
    return [
        ("self, no mask", lambda: m(x, x, x), reference(x, x, x, w)),
        (
            "cross, padding (B,1,T_k)",
            lambda: m(q, k, v, mask=pad[:, None, :]),
            reference(q, k, v, w, pad[:, None, None]),
        ),
        ("self, causal+padding (B,T,T)", lambda: m(x, x, x, mask=both), reference(x, x, x, w, both[:, None])),
        (
            "self, padding as 0/1 ints",
            lambda: m(x, x, x, mask=pad[:, None].long()),
            reference(x, x, x, w, pad[:, None, None]),
        ),
    ]


def build_d2l(cls):
    m = cls(E, H, 0.0)
    x = torch.zeros(1, 2, E)
    m(x, x, x, None)  # LazyLinear takes its input width from the first call
    for layer in m.modules():  # a mistake may leave one projection unused, so still lazy: the reference needs it
        if isinstance(layer, torch.nn.modules.lazy.LazyModuleMixin) and layer.has_uninitialized_params():
            layer.initialize_parameters(x)
    return m


def weights_d2l(m):
    return (*lin(m.W_q), *lin(m.W_k), *lin(m.W_v), *lin(m.W_o), H, H)


def cases_d2l(m, w):
    x, q, k, v = inputs()
    lens = torch.tensor(LENGTHS)
    per_query = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 3, 5, 2, 6, 1]])  # (B, T_q)
    keep_q = torch.arange(T)[None, None, :] < per_query[:, :, None]  # (B, T_q, T_k)
    return [
        ("cross, no lengths", lambda: m(q, k, v, None), reference(q, k, v, w)),
        ("cross, valid_lens (B,)", lambda: m(q, k, v, lens), reference(q, k, v, w, pad_keep()[:, None, None])),
        ("cross, valid_lens (B,T_q)", lambda: m(q, k, v, per_query), reference(q, k, v, w, keep_q[:, None])),
        ("self, valid_lens (B,)", lambda: m(x, x, x, lens), reference(x, x, x, w, pad_keep()[:, None, None])),
    ]


def build_nanogpt(cls):
    return cls(SimpleNamespace(n_embd=E, n_head=H, dropout=0.0, bias=True, block_size=16))


def weights_nanogpt(m):
    Wq, Wk, Wv = m.c_attn.weight.split(E, dim=0)
    bq, bk, bv = m.c_attn.bias.split(E, dim=0)
    return (Wq, bq, Wk, bk, Wv, bv, *lin(m.c_proj), H, H)


def cases_nanogpt(m, w):
    x, q, _, _ = inputs()
    return [
        ("T=7, causal", lambda: m(x), reference(x, x, x, w, causal_keep())),
        ("T=6, causal", lambda: m(q), reference(q, q, q, w, causal_keep(T_Q))),
    ]


def build_bert(cls):
    return cls(SimpleNamespace(hidden_size=E, num_attention_heads=H, attention_probs_dropout_prob=0.0))


def weights_bert(m):
    s = m.self
    return (*lin(s.query), *lin(s.key), *lin(s.value), *lin(m.output.dense), H, H)


def cases_bert(m, w):
    x, *_ = inputs()
    keep = pad_keep()[:, None, None]  # (B, 1, 1, T)
    return [
        ("no mask", lambda: m(x), reference(x, x, x, w)),
        ("padding, finfo.min", lambda: m(x, additive(keep)), reference(x, x, x, w, keep)),
        ("padding, -10000.0", lambda: m(x, additive(keep, fill=-10000.0)), reference(x, x, x, w, keep)),
    ]


def build_torchwrap(cls):
    return cls(E, H, dropout=0.0)


def weights_torchwrap(m):
    a = m.attn
    Wq, Wk, Wv = a.in_proj_weight.split(E, dim=0)
    bq, bk, bv = a.in_proj_bias.split(E, dim=0)
    return (Wq, bq, Wk, bk, Wv, bv, *lin(a.out_proj), H, H)


def cases_torchwrap(m, w):
    x, *_ = inputs()
    pad = pad_keep()
    causal = causal_keep()
    return [
        ("no mask", lambda: m(x), reference(x, x, x, w)),
        ("key_padding_mask", lambda: m(x, key_padding_mask=~pad), reference(x, x, x, w, pad[:, None, None])),
        ("attn_mask causal", lambda: m(x, attn_mask=~causal), reference(x, x, x, w, causal)),
        (
            "both",
            lambda: m(x, key_padding_mask=~pad, attn_mask=~causal),
            reference(x, x, x, w, causal & pad[:, None, None]),
        ),
    ]


def build_llama(cls):
    cfg = SimpleNamespace(
        hidden_size=E, num_attention_heads=H, num_key_value_heads=G, head_dim=E // H, attention_dropout=0.0
    )
    return cls(cfg)


def weights_llama(m):
    return (*lin(m.q_proj), *lin(m.k_proj), *lin(m.v_proj), *lin(m.o_proj), H, G)


def cases_llama(m, w):
    x, *_ = inputs()
    causal = causal_keep()[None, None].expand(B, 1, T, T)  # (B, 1, T, T)
    both = causal & pad_keep()[:, None, None]
    return [
        ("no mask", lambda: m(x), reference(x, x, x, w)),
        ("causal", lambda: m(x, additive(causal)), reference(x, x, x, w, causal)),
        ("causal+padding", lambda: m(x, additive(both)), reference(x, x, x, w, both)),
    ]


DRIVERS = {s: (globals()[f"build_{s}"], globals()[f"weights_{s}"], globals()[f"cases_{s}"]) for s in STYLES}


def run_cases(path: Path):
    """[(label, max abs diff from the reference, or the exception it raised)] for one corpus file."""
    mod = load(path)
    build, weights, cases = DRIVERS[mod.STYLE]
    torch.manual_seed(0)
    m = build(getattr(mod, mod.TARGET)).double().eval()
    results = []
    with torch.no_grad():
        for label, call, want in cases(m, weights(m)):
            try:
                got = first(call())
            except Exception as err:  # a mistake may break one call form; the others must still show it
                results.append((label, err))
                continue
            assert got.shape == want.shape, (
                f"{path.name} [{label}]: output {tuple(got.shape)}, want {tuple(want.shape)}"
            )
            diff = (got - want).abs().nan_to_num(nan=math.inf)  # a NaN output is as wrong as can be
            results.append((label, diff.max().item()))
    return results


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_declares_its_ground_truth(path):
    consts = declared(path)
    missing = {"EXPECTED", "TARGET", "STYLE", "CALL"} - consts.keys()
    assert not missing, f"{path.name} lacks {sorted(missing)}"
    assert consts["STYLE"] in STYLES and path.stem.startswith(consts["STYLE"] + "_")
    known = {m.id for m in MISTAKES} | NEW_IDS
    assert consts["EXPECTED"] == "pass" or consts["EXPECTED"] in known, (
        f"{path.name}: unknown id {consts['EXPECTED']!r}"
    )
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert "Mistake:" in doc, f"{path.name}: the docstring must say 'Mistake: none.' or name the mistake"
    assert ("Mistake: none" in doc) == (consts["EXPECTED"] == "pass")


def test_every_style_has_correct_and_mistake_files():
    seen = Counter((declared(p)["STYLE"], declared(p)["EXPECTED"] == "pass") for p in FILES)
    for style in STYLES:
        assert seen[(style, True)] >= 1, f"{style}: no correct module"
        assert seen[(style, False)] >= 4, f"{style}: {seen[(style, False)]} mistake modules, want >= 4"


# torchwrap_padding_mask_added's float key_padding_mask makes nn.MultiheadAttention warn; the warning is its story
@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask and attn_mask:UserWarning")
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_against_reference(path):
    results = run_cases(path)
    table = "; ".join(f"{label}: {r if isinstance(r, Exception) else f'{r:.2e}'}" for label, r in results)
    if declared(path)["EXPECTED"] == "pass":
        bad = [(label, r) for label, r in results if isinstance(r, Exception) or r > EXACT]
        assert not bad, f"{path.name} is declared correct but misses the reference: {table}"
    else:
        worst = max((r for _, r in results if not isinstance(r, Exception)), default=0.0)
        assert worst > VISIBLE, f"{path.name} ({declared(path)['EXPECTED']}) matches the reference: {table}"


def test_reference_is_plain_attention():
    """The reference agrees with torch's own SDPA, so that 'matches the reference' means 'is attention'."""
    _, q, k, v = inputs()
    g = torch.Generator().manual_seed(1)
    Ws = [torch.randn(E, E, generator=g, dtype=torch.float64) / math.sqrt(E) for _ in range(4)]
    w = (Ws[0], None, Ws[1], None, Ws[2], None, Ws[3], None, H, H)
    keep = pad_keep()[:, None, None]
    qh, kh, vh = (F.linear(t, W).view(B, -1, H, E // H).transpose(1, 2) for t, W in zip((q, k, v), Ws, strict=False))
    sdpa = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=keep)  # (B, H, T_q, D)
    want = F.linear(sdpa.transpose(1, 2).reshape(B, T_Q, E), Ws[3])
    assert (reference(q, k, v, w, keep) - want).abs().max().item() < EXACT
