"""``attnlab bench-decode`` runs end to end on a tiny model (a smoke test: nothing is timed here)."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch

from attnlab.bench.decode import _compact
from attnlab.cli import main
from attnlab.models.generation import generate
from attnlab.models.llama import Llama, LlamaConfig


def test_bench_decode_writes_a_table_and_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.chdir(tmp_path)  # a short --out-dir, so that the paths it prints fit too
    args = [
        "bench-decode",
        "--contexts",
        "8",
        "16",
        "--max-new-tokens",
        "3",
        "--recompute-max-new-tokens",
        "3",
        "--repeats",
        "1",
        "--num-layers",
        "1",
        "--num-heads",
        "2",
        "--embed-dim",
        "16",
        "--vocab-size",
        "64",
        "--out-dir",
        "out",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    tmp_path = tmp_path / "out"
    assert (
        re.search(r"context +cache +recompute", out) and "greedy tokens identical across runners: yes" in out
    )  # widths follow the figures
    assert "| context |" in (tmp_path / "decode.md").read_text()  # the full table, tokens/s too
    report = json.loads((tmp_path / "decode.json").read_text())
    assert [r["context"] for r in report["results"]] == [8, 16]
    for row in report["results"]:
        assert set(row["same_tokens"]) == {"attnlab cache", "attnlab recompute", "HF generate"}
        assert all(
            isinstance(row[name]["ms_per_token"], float) for name in row["same_tokens"]
        )  # noise may make a 1-repeat figure meaningless, never absent


def test_printed_table_fits_80_columns_with_every_runner():
    names = ["attnlab cache", "attnlab recompute", "attnlab cache+compile", "HF generate"]
    row = {"context": 16384, "cache_GB_per_s": 1234.5}
    for i, name in enumerate(names):
        ms = [6.54, 1111.5, 5.67, 11.17][i]
        row[name] = {"ms_per_token": ms, "tokens_per_s": 1e3 / ms}
    lines = _compact([row], names, hf=True).splitlines()
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    assert lines[-2].split() == ["context", "cache", "recompute", "compiled", "HF", "speedup", "GB/s", "vs", "HF"]
    assert lines[-1].split() == ["16384", "6.54", "1111.50", "5.67", "11.17", "170.0x", "1234.5", "1.71x"]


def _tiny_hf_llama_dir(path, tied: bool = True):
    """A random-init Hugging Face Llama (GQA) saved as save_pretrained writes it: no 135M download needed."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    return path


def test_bench_decode_model_writes_json_for_every_dtype_and_batch(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.chdir(tmp_path)
    _tiny_hf_llama_dir(tmp_path / "tiny")
    args = ["bench-decode", "--model", "tiny", "--batch-sizes", "1", "3", "--prompt-len", "5"]
    assert main([*args, "--max-new-tokens", "4", "--repeats", "1", "--threads", "1", "--out-dir", "out"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80, out
    report = json.loads((tmp_path / "out" / "decode_model.json").read_text())
    assert report["copy_GB_per_s"] > 0 and report["max_new_tokens"] == 4 and report["prompt_len"] == 5
    assert [(r["dtype"], r["batch"]) for r in report["results"]] == [
        ("float32", 1),
        ("float32", 3),
        ("bfloat16", 1),
        ("bfloat16", 3),
    ]
    for row in report["results"]:
        assert set(row["same_tokens"]) == {"attnlab", "HF default"}
        assert row["same_tokens"]["HF default"] or row["dtype"] == "bfloat16"  # fp32 greedy: the same model
        for name in row["same_tokens"]:
            assert row[name]["prefill_tokens_per_s"] > 0  # t(1) > 0 always
            # (t(n) - t(1)) / (n - 1) over 1 noisy repeat may be meaningless here, never absent
            assert all(isinstance(row[name][k], float) for k in ("tokens_per_s", "bandwidth_fraction"))
    assert "| dtype | batch |" in (tmp_path / "out" / "decode_model.md").read_text()


def test_bench_decode_model_refuses_sweep_flags_by_name(tmp_path, capsys):
    assert main(["bench-decode", "--model", str(tmp_path), "--num-layers", "2"]) == 2
    assert "--num-layers" in capsys.readouterr().err
    assert main(["bench-decode", "--batch-sizes", "2"]) == 2  # a --model flag without --model
    assert "--model" in capsys.readouterr().err


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_column_major_output_head_keeps_logits_and_saves_row_major(tied):
    """The Llama's (V, E) output weight is stored column-major for decode speed; logits equal the
    row-major matmul's (1e-5), and state_dict() hands out an ordinary contiguous (V, E) tensor."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, block_size=32, n_layer=2, n_embd=32, n_head=4, n_kv_head=2, tie_embeddings=tied)
    model = Llama(config).eval()
    head = model.output_weight
    assert head.shape == (96, 32) and head.stride() == (1, 96)  # column-major (V, E)
    idx = torch.randint(0, 96, (3, 7))
    row_major = copy.deepcopy(model)
    holder = row_major.embed if tied else row_major.lm_head
    holder.weight = torch.nn.Parameter(holder.weight.detach().contiguous())
    with torch.no_grad():
        torch.testing.assert_close(model(idx), row_major(idx), atol=1e-5, rtol=1e-5)
        ours = generate(model, idx, 5, temperature=0)
        assert torch.equal(ours, generate(row_major, idx, 5, temperature=0))
    state = model.state_dict()
    key = "embed.weight" if tied else "lm_head.weight"
    assert state[key].is_contiguous() and torch.equal(state[key], head)
    assert "lm_head.weight" not in state if tied else "lm_head.weight" in state
    reloaded = Llama(config)
    reloaded.load_state_dict(state)
    assert reloaded.output_weight.stride() == (1, 96)  # copy_ keeps the layout


def test_bench_decode_model_gguf_source_adds_the_stored_model_and_llama_cpp(tmp_path, capsys, monkeypatch):
    """A GGUF source gets attnlab on the file's blocks and llama.cpp's column; llama.cpp itself is a stand-in here
    (a real build takes ~15 min): it must be given the file, the context and the threads, and run at batch 1 only."""
    gguf = pytest.importorskip("gguf")
    import attnlab.bench.decode as decode
    from attnlab import from_pretrained, generate
    from test_pretrained import write_llama_gguf

    monkeypatch.setenv("COLUMNS", "80")
    path = tmp_path / "q.gguf"
    write_llama_gguf(path, tied=True, all_quantized=gguf.GGMLQuantizationType.Q4_1)
    reference, _ = from_pretrained(path)
    asked = {}

    def stand_in(file, n_ctx, threads):
        asked.update(file=file, n_ctx=n_ctx, threads=threads)
        return lambda idx, n: generate(reference, idx, n, temperature=0)  # llama.cpp's greedy tokens, as it were

    monkeypatch.setattr(decode, "_llama_cpp_available", lambda: None)
    monkeypatch.setattr(decode, "_llama_cpp_runner", stand_in)
    args = ["bench-decode", "--model", str(path), "--batch-sizes", "1", "2", "--prompt-len", "5", "--dtype", "float32"]
    out_dir = tmp_path / "out"
    assert (
        main([*args, "--max-new-tokens", "4", "--repeats", "1", "--threads", "1", "--no-hf", "--out-dir", str(out_dir)])
        == 0
    )
    assert asked == {"file": path, "n_ctx": 5 + 4 + 8, "threads": 1}
    printed = capsys.readouterr().out
    assert max(len(line) for line in printed.splitlines()) <= 80 and "l.cpp" in printed and "gguf" in printed
    report = json.loads((out_dir / "decode_model.json").read_text())
    assert report["cpu"]["vendor"] and isinstance(report["cpu"]["flags"], list) and report["failed"] == {}
    one, two = report["results"]
    assert set(one["same_tokens"]) == {"attnlab", "attnlab gguf", "llama.cpp"} and one["same_tokens"]["llama.cpp"]
    assert "llama.cpp" not in two and "attnlab gguf" in two  # llama-cpp-python decodes one sequence at a time
    quantized, _ = from_pretrained(path, dtype="gguf")
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    kv = 1 * (5 + 4 / 2) * reference.kv_cache_bytes_per_token
    assert one["attnlab gguf"]["bytes_per_token"] == quantized.weight_bytes() + kv
    assert one["llama.cpp"]["bytes_per_token"] == file_bytes + kv / 2  # its K/V cache is float16
    assert one["attnlab"]["bytes_per_token"] == reference.num_params() * 4 + kv
    for name in ("attnlab", "attnlab gguf", "llama.cpp"):
        r = one[name]
        assert r["bandwidth_fraction"] == pytest.approx(
            r["bytes_per_token"] / (report["copy_GB_per_s"] * 1e9) / (r["ms_per_token"] / 1e3)
        )
    assert "llama.cpp" in (out_dir / "decode_model.md").read_text()


def test_bench_decode_model_says_why_llama_cpp_is_left_out(tmp_path, capsys, monkeypatch):
    gguf = pytest.importorskip("gguf")
    import attnlab.bench.decode as decode
    from test_pretrained import write_llama_gguf

    path = tmp_path / "q.gguf"
    write_llama_gguf(path, tied=True, all_quantized=gguf.GGMLQuantizationType.Q8_0)
    monkeypatch.setattr(decode, "_llama_cpp_available", lambda: "llama_cpp not importable (ModuleNotFoundError)")
    args = ["bench-decode", "--model", str(path), "--batch-sizes", "1", "--prompt-len", "4", "--dtype", "float32"]
    assert main([*args, "--max-new-tokens", "3", "--repeats", "1", "--no-hf", "--out-dir", str(tmp_path / "o")]) == 0
    report = json.loads((tmp_path / "o" / "decode_model.json").read_text())
    assert report["failed"] == {"llama.cpp": "llama_cpp not importable (ModuleNotFoundError)"}
    assert "llama.cpp left out: llama_cpp not importable" in capsys.readouterr().out


@pytest.mark.parametrize("source", ["nope.gguf", "no-such-dir"])
def test_bench_decode_model_refuses_a_missing_file_before_saying_it_loads(tmp_path, capsys, monkeypatch, source):
    """It used to print 'loading nope.gguf ...' on stdout, then the error."""
    monkeypatch.chdir(tmp_path)
    assert main(["bench-decode", "--model", source]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("attnlab: error: ") and repr(source) in err and err.count("\n") == 1, (out, err)
