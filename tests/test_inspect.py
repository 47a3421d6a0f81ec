"""attnlab.inspect: capture leaves models as they were, every score means what its docstring says,
the CLI writes its files, and on the real SmolLM2 the strongest heads match an independent computation."""

from __future__ import annotations

import json

import pytest
import torch

import attnlab
from attnlab.cli import main
from attnlab.heads import capture_attention, classify, make_probe, probe_scores, text_scores
from attnlab.models.gpt import GPTConfig, TinyGPT
from attnlab.weight_files.saved_model import save_checkpoint
from smollm2_fixtures import attnlab_smollm2, hf_smollm2, require_smollm2


def tiny(seed: int = 0, **kw) -> TinyGPT:
    torch.manual_seed(seed)
    cfg = {"vocab_size": 40, "block_size": 128, "n_layer": 2, "n_head": 4, "n_embd": 32, **kw}
    return TinyGPT(GPTConfig(**cfg)).eval()


def causal_rows(t: int, pick) -> torch.Tensor:
    """(1, 1, T, T) weights where row i is one-hot on key pick(i) (clamped to 0 .. i)."""
    w = torch.zeros(1, 1, t, t)
    for i in range(t):
        w[0, 0, i, max(0, min(i, pick(i)))] = 1.0
    return w


def test_capture_returns_the_weights_and_leaves_the_model_untouched():
    model = tiny()
    idx = torch.randint(0, 40, (2, 12))
    with torch.no_grad():
        before = model(idx)
        with capture_attention(model) as cap:
            during = model(idx)
        after = model(idx)
    torch.testing.assert_close(during, before, atol=1e-5, rtol=1e-5)  # math backend inside, same model output
    assert torch.equal(after, before)
    assert all("forward" not in block.attn.__dict__ for block in model.transformer.h)  # nothing left patched
    assert model.transformer.h[0].attn.last_backend == "sdpa"  # normal calls take the fused path again
    w = cap.weights[0]
    assert w.shape == (2, 4, 12, 12)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 12))
    assert torch.all(w.triu(1) == 0)  # causal: no weight on the future


def test_capture_restores_forward_after_an_exception():
    model = tiny()
    with pytest.raises(RuntimeError, match="boom"), capture_attention(model):
        raise RuntimeError("boom")
    assert all("forward" not in block.attn.__dict__ for block in model.transformer.h)


def test_text_scores_on_patterns_with_known_answers():
    t = 10
    prev = text_scores(causal_rows(t, lambda i: i - 1))
    assert prev["prev_token"].item() == pytest.approx(1.0)
    assert prev["distance"].item() == pytest.approx(1.0)
    assert prev["diagonal"].item() == pytest.approx(0.0)
    sink = text_scores(causal_rows(t, lambda i: 0))
    assert sink["sink"].item() == pytest.approx(1.0)
    assert sink["distance"].item() == pytest.approx(sum(range(1, t)) / (t - 1))
    uniform = torch.tril(torch.ones(t, t)) / torch.arange(1, t + 1)[:, None]
    u = text_scores(uniform[None, None])
    assert u["uniformity"].item() == pytest.approx(1.0, abs=1e-6)
    assert u["entropy"].item() == pytest.approx(sum(torch.log(torch.arange(2, t + 1).double()).tolist()) / (t - 1))


def test_text_scores_skip_padding_rows_and_count_from_the_first_real_token():
    t, pad = 8, 3
    w = causal_rows(t, lambda i: pad)  # every real row looks at the first real token
    w[0, 0, :pad] = 0.0  # padding rows: fully masked
    mask = torch.tensor([[True] * pad + [False] * (t - pad)])
    s = text_scores(w, mask)
    assert s["sink"].item() == pytest.approx(1.0)


def test_probe_scores_find_an_induction_and_a_duplicate_pattern():
    n = 6
    ind = causal_rows(2 * n, lambda i: i - n + 1 if i >= n else i)
    dup = causal_rows(2 * n, lambda i: i - n if i >= n else i)
    assert probe_scores(ind, n)["induction"].item() == pytest.approx(1.0)
    assert probe_scores(ind, n)["duplicate"].item() == pytest.approx(0.0)
    assert probe_scores(dup, n)["duplicate"].item() == pytest.approx(1.0)


def test_classify_applies_the_rules_in_order():
    names = ("induction", "duplicate", "prev_token", "sink", "distance", "uniformity")
    base = {n: torch.zeros(1, 3) for n in names}
    base["distance"] += 10.0
    base["induction"][0, 0] = 0.9
    base["prev_token"][0, 0] = 0.9  # induction wins: it comes first
    base["sink"][0, 1] = 0.7
    assert classify(base) == [["induction", "sink", "mixed"]]


def test_make_probe_repeats_a_seeded_sequence():
    p = make_probe(1000, 7, 3, seed=1)
    assert p.shape == (3, 14) and torch.equal(p[:, :7], p[:, 7:])
    assert torch.equal(p, make_probe(1000, 7, 3, seed=1))
    assert int(p.min()) >= 20  # past the first vocab_size // 50 ids


def test_inspect_with_left_padding_reports_masks_and_shapes():
    model = tiny()
    report = attnlab.inspect(model, list(range(1, 16)), left_pad=4)
    assert report.n_layers == 2 and report.n_heads == 4
    assert len(report.tokens) == 19 and report.key_padding[:4] == [True] * 4
    w = report.weights[0]  # (H, T, T)
    assert torch.all(w[:, :, :4] == 0)  # padded keys never attended
    assert torch.all(w[:, :4] == 0)  # padding rows see only padding: fully masked, zeros, not NaN
    torch.testing.assert_close(w[:, 4:].sum(-1), torch.ones(4, 15))
    data = report.to_json()
    assert set(data["scores"]) == set(attnlab.heads.SCORE_NAMES)
    assert len(data["kinds"]) == 2 and len(data["kinds"][0]) == 4
    assert data["probe"]["n"] == 50


def test_inspect_refuses_bad_input():
    model = tiny()
    with pytest.raises(ValueError, match="no tokenizer"):
        attnlab.inspect(model, "hello")
    with pytest.raises(ValueError, match="at least 2"):
        attnlab.inspect(model, [3])
    with pytest.raises(TypeError, match="no attnlab.MultiHeadAttention"):
        attnlab.inspect(torch.nn.Linear(2, 2), [1, 2])


def test_cli_inspect_writes_json_png_and_prints_kinds(tmp_path, capsys):
    model = tiny()
    ckpt = save_checkpoint(model, tmp_path / "model", tokenizer=attnlab.CharTokenizer("abcdefghijklmnopqrstuvwxyz .,"))
    out = tmp_path / "inspect"
    code = main(
        ["inspect", "--checkpoint", str(ckpt), "--text", "the cat sat on the mat", "--out-dir", str(out), "--no-page"]
    )
    assert code == 0
    data = json.loads((out / "heads.json").read_text())
    assert data["format"] == "attnlab.heads/1"
    assert data["text"]["tokens"][:3] == ["t", "h", "e"]
    assert (out / "heads.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "heads of each kind per layer:" in printed and "induction (induction >= 0.4): strongest L" in printed


def test_cli_inspect_needs_exactly_one_source(capsys):
    assert main(["inspect"]) == 2
    assert "exactly one of --model" in capsys.readouterr().err


# -- the real model -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_report():
    require_smollm2()
    model, tok = attnlab_smollm2()
    return attnlab.inspect(model, "The capital of France is Paris, and the capital of Italy is Rome.", tokenizer=tok)


@pytest.mark.slow
def test_smollm2_strongest_induction_and_previous_token_heads_match_hf_eager(smollm2_report):
    """The probe through Hugging Face's own eager attention, scored here with plain indexing."""
    hf, _ = hf_smollm2()
    report = smollm2_report
    n, batch = report.probe["n"], report.probe["batch"]
    probe = make_probe(49152, n, batch, seed=report.probe["seed"])
    hf.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attentions = hf(probe, output_attentions=True).attentions  # per layer (B, H, 2n, 2n)
    finally:
        hf.set_attn_implementation("sdpa")
    induction = torch.zeros(len(attentions), 9)
    for layer, a in enumerate(attentions):
        for k in range(n - 1):
            induction[layer] += a[:, :, n + k, k + 1].mean(0) / (n - 1)
    best = int(induction.argmax())
    ours = report.top("induction", 1)[0]
    assert (ours[0], ours[1]) == (best // 9, best % 9)
    assert ours[2] == pytest.approx(float(induction.flatten()[best]), abs=1e-3)
    assert ours[2] > 0.5  # SmolLM2 copies in context: a strong induction head exists
    assert report.probe["loss_second_copy"] < report.probe["loss_first_copy"] / 2

    text_ids = torch.tensor([report.token_ids])
    hf.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attentions = hf(text_ids, output_attentions=True).attentions
    finally:
        hf.set_attn_implementation("sdpa")
    t = text_ids.size(1)
    prev = torch.stack([a[0, :, torch.arange(1, t), torch.arange(0, t - 1)].mean(-1) for a in attentions])  # (L, H)
    best = int(prev.argmax())
    ours = report.top("prev_token", 1)[0]
    assert (ours[0], ours[1]) == (best // 9, best % 9)
    assert ours[2] == pytest.approx(float(prev.flatten()[best]), abs=1e-3)
