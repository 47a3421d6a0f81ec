"""One ``--dtype`` vocabulary for every command that loads a real model, a default per task, and the line that
says which weights ran and why (``attnlab.weight_files.precision``).

The choice itself is tested for every (task, source, device) pair without loading anything; the
commands are run in process on the real SmolLM2 where the path matters (generate's default is the
GGUF's blocks as stored, and its greedy answer is the API's on the same weights), and on stand-ins
where only the flag and the printed line are under test.
"""

from __future__ import annotations

import re

import pytest
import torch

import attnlab
from attnlab.cli import main
from attnlab.core.kv_cache import CPU_FUSED_KV_DTYPE, kv_cache_choice, kv_values_per_position, resolve_kv_dtype
from attnlab.runtime import UsageError
from attnlab.tools import generate_cli
from attnlab.weight_files import precision, pretrained
from attnlab.weight_files.precision import WEIGHT_DTYPES, choose_weights, is_gguf_source, parse_weights
from smollm2_fixtures import attnlab_smollm2, require_smollm2

CPU = torch.device("cpu")
QUESTION = "Explain attention in one paragraph."  # the demo's question


@pytest.fixture
def kernels(monkeypatch):
    """The quantized kernels as built (True) or not, whatever this machine's compiler did."""

    def set_built(built: bool) -> None:
        monkeypatch.setattr(precision, "_kernels", lambda: (built, "" if built else "no C++ compiler (g++)"))

    set_built(True)
    return set_built


# -- the vocabulary ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "name"),
    [
        ("auto", "auto"),
        ("gguf", "gguf"),
        ("float32", "float32"),
        ("fp32", "float32"),
        ("BF16", "bfloat16"),
        ("half", "float16"),
        ("float64", "float64"),
        (torch.bfloat16, "bfloat16"),
        (torch.float16, "float16"),
    ],
)
def test_every_spelling_names_one_weight_dtype(given, name):
    assert parse_weights(given) == name


@pytest.mark.parametrize(("given", "flag"), [("q4", "--dtype"), ("int8", "dtype"), (torch.int8, "dtype")])
def test_an_unknown_name_is_refused_naming_the_flag_the_choices_and_an_example(given, flag):
    shown = str(given) if isinstance(given, torch.dtype) else repr(given)
    example = "--dtype bfloat16" if flag == "--dtype" else 'dtype="bfloat16"'
    with pytest.raises(UsageError) as e:
        parse_weights(given, flag)
    assert str(e.value) == (
        f"{flag} {shown} is not a weight dtype; use auto (the task's default), gguf (a GGUF file's blocks as stored), "
        f"float32, bfloat16 or float16, e.g. {example}."
    )


def test_the_vocabulary_is_the_one_the_commands_document():
    """generate, inspect and bench-decode name the same choices in --help (inspect leaves float16 out)."""
    from attnlab.bench.decode import bench_decode
    from attnlab.tools.inspect_cli import inspect_command

    for command, names in (
        (generate_cli.generate_command, WEIGHT_DTYPES),
        (inspect_command, ("auto", "gguf", "float32", "bfloat16")),
        (bench_decode, WEIGHT_DTYPES),
    ):
        doc = command.__doc__ or ""
        # The argument's paragraph: from "dtype:" to the next blank line or argument.
        paragraph = re.split(r"\n\s*\n|\n\s{0,8}\w+: ", doc[doc.index("dtype: ") :])[0]
        missing = [name for name in names if re.search(rf"\b{name}\b", paragraph) is None]
        assert not missing, (command.__name__, missing, paragraph)


@pytest.mark.parametrize(
    ("source", "gguf"), [("smollm2", True), ("SmolLM2", True), ("m.gguf", True), ("M.GGUF", True), ("runs/x", False)]
)
def test_gguf_sources_are_told_by_name_without_loading(source, gguf):
    assert is_gguf_source(source) is gguf


def test_any_file_is_a_gguf_source_as_from_pretrained_reads_it(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"GGUF")
    assert is_gguf_source(tmp_path / "weights.bin") and not is_gguf_source(tmp_path)


# -- the default per task, and its reason ----------------------------------------------------------------------------


def test_generate_runs_a_gguf_file_as_stored_on_a_cpu(kernels):
    choice = choose_weights("auto", task="generate", source="smollm2", device=CPU)
    assert choice.dtype == "gguf" and not choice.asked
    assert choice.line("Q8_0 blocks as stored, int8 tiles on AVX2") == (
        "attnlab: weights gguf (Q8_0 blocks as stored, int8 tiles on AVX2): generate's default for a GGUF file on a "
        "CPU: the model the file holds, as llama.cpp runs it, 5.6x fewer bytes per token than float32; --dtype "
        "float32 for the exact float model"
    )


def test_generate_takes_float32_for_a_gguf_file_when_the_kernels_could_not_be_built(kernels):
    kernels(False)
    choice = choose_weights("auto", task="generate", source="smollm2", device=CPU)
    assert choice.dtype == torch.float32
    assert "without attnlab's quantized kernels (no C++ compiler (g++))" in choice.reason
    assert "float32 is faster than the blocks in plain PyTorch" in choice.reason


def test_generate_keeps_float32_for_other_sources_on_a_cpu(tmp_path):
    choice = choose_weights("auto", task="generate", source=tmp_path, device=CPU)
    assert choice.dtype == torch.float32
    assert choice.reason.startswith("generate's default on a CPU: bfloat16 is no faster there")


@pytest.mark.parametrize("bf16", [True, False])
@pytest.mark.parametrize("source", ["smollm2", "hf_dir"])
def test_generate_on_cuda_takes_what_the_gpu_computes_in(monkeypatch, bf16, source):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)
    choice = choose_weights("auto", task="generate", source=source, device=torch.device("cuda"))
    assert choice.dtype == (torch.bfloat16 if bf16 else torch.float16)
    assert ("this GPU has no bfloat16" in choice.reason) is not bf16
    assert ("its blocks are dequantized once at load" in choice.reason) is (source == "smollm2")


@pytest.mark.parametrize("source", ["smollm2", "hf_dir"])
def test_inspect_reads_the_exact_float_model_and_says_how_to_see_the_other(source):
    choice = choose_weights("auto", task="inspect", source=source, device=CPU)
    assert choice.dtype == torch.float32
    assert choice.reason.startswith("inspect's default: attention weights read from the exact float model; ")
    assert choice.reason.endswith(
        "--dtype gguf for the quantized model as it runs" if source == "smollm2" else "memory"
    )


def test_a_named_dtype_is_taken_as_asked_and_said_so():
    choice = choose_weights("bf16", task="generate", source="smollm2", device=CPU)
    assert choice.dtype == torch.bfloat16 and choice.asked
    assert choice.line() == "attnlab: weights bfloat16: --dtype bfloat16 asked for it"


def test_gguf_is_refused_for_a_directory_and_off_the_cpu(tmp_path):
    with pytest.raises(UsageError, match=r"^--dtype gguf keeps a GGUF file's blocks as stored, but .* is not a \.gguf"):
        choose_weights("gguf", task="generate", source=tmp_path, device=CPU)
    with pytest.raises(UsageError, match=r"^dtype gguf on cuda: attnlab's quantized kernels are CPU code; pass dtype"):
        choose_weights("gguf", task="generate", source="smollm2", device=torch.device("cuda"), flag="dtype")


# -- the Python API takes the same names ----------------------------------------------------------------------------


def test_from_pretrained_takes_the_names_and_refuses_an_unknown_one_before_looking_for_the_file(tmp_path):
    with pytest.raises(UsageError, match=r"^dtype 'q4' is not a weight dtype"):
        pretrained.from_pretrained(tmp_path / "missing", dtype="q4")
    with pytest.raises(UsageError, match=r"^dtype gguf keeps a GGUF file's blocks as stored, but"):
        pretrained.from_pretrained(tmp_path, dtype="gguf")


def test_from_pretrained_auto_is_generates_default_and_names_are_torch_dtypes(monkeypatch, kernels):
    require_smollm2()
    seen = []
    monkeypatch.setattr(
        pretrained, "_from_gguf", lambda path, dtype, device: seen.append(dtype) or (torch.nn.Identity(), "t")
    )
    for given in ("auto", "gguf", "bfloat16", torch.float16, "fp32"):
        pretrained.from_pretrained("smollm2", dtype=given)
    model, _ = pretrained.from_pretrained("smollm2")  # the default is "auto": what attnlab generate runs
    assert seen == ["gguf", "gguf", torch.bfloat16, torch.float16, torch.float32, "gguf"]
    assert model.weights_line.startswith("attnlab: weights gguf: generate's default for a GGUF file on a CPU")


# -- the commands: the default path, the flag, the line -------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_smollm2():
    require_smollm2()
    return pretrained.from_pretrained("smollm2", dtype="gguf")


@pytest.fixture
def served(monkeypatch, gguf_smollm2):
    """``from_pretrained("smollm2", dtype=...)`` served by the session's copies (gguf and float32); ``.dtypes``
    lists what each load asked for."""
    real = pretrained.from_pretrained
    dtypes: list[object] = []

    def cached(source, dtype=torch.float32, **kwargs):
        if source != "smollm2":
            return real(source, dtype=dtype, **kwargs)
        dtypes.append(dtype)
        return (
            gguf_smollm2
            if dtype == "gguf"
            else attnlab_smollm2()
            if dtype == torch.float32
            else real(source, dtype=dtype)
        )

    monkeypatch.setattr(pretrained, "from_pretrained", cached)
    return dtypes


def _weights_line(err: str) -> str:
    (line,) = [ln for ln in err.splitlines() if ln.startswith("attnlab: weights ")]
    return line


GENERATE = ["generate", "--model", "smollm2", "--chat", "--prompt", QUESTION, "--temperature", "0"]


def test_generate_chat_runs_the_blocks_as_stored_by_default_and_says_why(served, capsys):
    assert main([*GENERATE, "--max-new-tokens", "8"]) == 0
    line = _weights_line(capsys.readouterr().err)
    assert served == ["gguf"]
    assert re.match(r"attnlab: weights gguf \((Q\d_\d)( and Q\d_\d)* blocks as stored, ", line), line
    assert "generate's default for a GGUF file on a CPU: the model the file holds, as llama.cpp runs it" in line
    assert f"KV cache {CPU_FUSED_KV_DTYPE} (--kv-dtype auto on a CPU with the fused decode step" in line


def test_generate_stores_a_long_prompt_s_cache_in_int8_and_says_why(served, capsys, gguf_smollm2):
    model, tok = gguf_smollm2
    prompt = "The cat sat on the mat. " * 240
    n_ids = len(tok(prompt)["input_ids"])
    storage, words = kv_cache_choice(
        "auto", CPU, model.has_fused_decode, slots=n_ids + 1, per_slot=kv_values_per_position(model)
    )
    assert storage == "int8"  # a float16 cache of these positions would pass CPU_FUSED_FLOAT16_MAX_BYTES
    assert main(["generate", "--model", "smollm2", "--prompt", prompt, "--max-new-tokens", "1", "--greedy"]) == 0
    line = _weights_line(capsys.readouterr().err)
    assert f", {words}): " in line and f"{n_ids + 1} positions" in words, line


def test_generate_dtype_flag_loads_what_it_names(served, capsys):
    assert main([*GENERATE, "--max-new-tokens", "4", "--dtype", "float32"]) == 0
    assert served == [torch.float32]
    assert _weights_line(capsys.readouterr().err) == "attnlab: weights float32: --dtype float32 asked for it"


def test_generate_refuses_a_bad_dtype_before_loading(served, capsys):
    assert main([*GENERATE, "--dtype", "int4"]) == 2
    assert served == []
    assert capsys.readouterr().err.startswith("attnlab: error: --dtype 'int4' is not a weight dtype; use auto")


@pytest.mark.parametrize("dtype", ["gguf", "float32"])
def test_a_greedy_chat_answer_is_the_same_through_the_cli_and_the_api(served, capsys, dtype, gguf_smollm2):
    assert main([*GENERATE, "--max-new-tokens", "24", "--dtype", dtype]) == 0
    printed = capsys.readouterr().out
    model, tok = gguf_smollm2 if dtype == "gguf" else attnlab_smollm2()
    chat = [{"role": "user", "content": QUESTION}]
    idx = tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=True, return_tensors="pt")["input_ids"]
    kv, _ = resolve_kv_dtype("auto", torch.device("cpu"), model.has_fused_decode)  # the CLI's default KV cache
    out = attnlab.generate(model, idx, 24, temperature=0, eos_token_id=tok.eos_token_id, kv_dtype=kv)
    assert printed == tok.decode(out[0, idx.size(1) :], skip_special_tokens=True) + "\n"
    assert "attention" in printed.lower()


def test_generate_checkpoint_runs_float32_silently_and_refuses_gguf(tmp_path, capsys):
    from attnlab import GPTConfig, TinyGPT
    from attnlab.weight_files.saved_model import save_checkpoint

    save_checkpoint(TinyGPT(GPTConfig(vocab_size=300, block_size=16, n_layer=1, n_head=2, n_embd=16)), tmp_path)
    flags = ["generate", "--checkpoint", str(tmp_path), "--prompt", "ab", "--max-new-tokens", "3"]
    assert main(flags) == 0
    assert "attnlab: weights" not in capsys.readouterr().err  # a lab checkpoint in float32, as it always ran
    assert main([*flags, "--dtype", "bfloat16"]) == 0
    assert _weights_line(capsys.readouterr().err) == "attnlab: weights bfloat16: --dtype bfloat16 asked for it"
    assert main([*flags, "--dtype", "gguf"]) == 2
    assert "--dtype gguf keeps a GGUF file's blocks as stored, but" in capsys.readouterr().err


def test_inspect_runs_float32_by_default_and_gguf_when_asked(served, tmp_path, capsys):
    args = ["inspect", "--model", "smollm2", "--text", "The cat sat on the mat. The cat sat.", "--probe-len", "4"]
    assert main([*args, "--probe-batch", "1", "--no-page", "--out-dir", str(tmp_path / "a")]) == 0
    line = _weights_line(capsys.readouterr().err)
    assert line.startswith("attnlab: weights float32: inspect's default: attention weights read from the exact")
    assert main([*args, "--probe-batch", "1", "--no-page", "--out-dir", str(tmp_path / "b"), "--dtype", "gguf"]) == 0
    assert _weights_line(capsys.readouterr().err).startswith("attnlab: weights gguf (")
    assert served == [torch.float32, "gguf"]


def test_inspect_refuses_float16_naming_its_choices(capsys, tmp_path):
    assert main(["inspect", "--model", "smollm2", "--dtype", "float16", "--out-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        "attnlab: error: --dtype 'float16': inspect runs the model in auto, gguf, float32 or bfloat16 (its scores "
        "are float32 either way); pass --dtype float32 (the default) or --dtype bfloat16.\n"
    )


def test_bench_decode_names_its_rows_and_why(tmp_path):
    from attnlab.bench.decode import _model_dtypes

    dtypes, why = _model_dtypes("smollm2", "auto", CPU)
    assert dtypes == (torch.float32, torch.bfloat16)
    assert why.startswith("float32 and bfloat16, with the GGUF's blocks as stored and llama.cpp beside float32: ")
    assert _model_dtypes("smollm2", "gguf", CPU)[0] == ("gguf",)
    assert _model_dtypes(str(tmp_path), "bf16", CPU) == ((torch.bfloat16,), "bfloat16 (--dtype bfloat16 asked for it)")
    with pytest.raises(UsageError, match="--dtype gguf keeps a GGUF file's blocks as stored, but"):
        _model_dtypes(str(tmp_path), "gguf", CPU)


def test_bench_decode_refuses_gguf_for_the_random_sweep(capsys, tmp_path):
    assert main(["bench-decode", "--dtype", "gguf", "--out-dir", str(tmp_path)]) == 2
    assert "--dtype gguf runs a GGUF file's blocks as stored, and the GPT-2 sweep's model is random" in (
        capsys.readouterr().err
    )


def test_bench_decode_gguf_rows_run_the_blocks_and_their_bytes(monkeypatch, tmp_path, gguf_smollm2, capsys):
    """``--dtype gguf``: one row per batch of the blocks as stored (llama.cpp beside them where it imports), no
    float runner and no Hugging Face; the bytes a step reads are the blocks' plus the cache."""
    from attnlab.bench import decode

    monkeypatch.setattr(decode, "_llama_cpp_available", lambda: "not here")
    real = pretrained.from_pretrained
    monkeypatch.setattr(
        pretrained,
        "from_pretrained",
        lambda s, dtype=torch.float32, **kw: (
            gguf_smollm2 if dtype == "gguf" else attnlab_smollm2() if s == "smollm2" else real(s, dtype=dtype, **kw)
        ),
    )
    args = ["bench-decode", "--model", "smollm2", "--dtype", "gguf", "--batch-sizes", "1", "--prompt-len", "4"]
    assert main([*args, "--max-new-tokens", "3", "--repeats", "1", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out  # beside the progress lines: stderr stays for errors
    assert "\nweights gguf (--dtype gguf asked for it): the file's blocks as stored," in out
    import json

    (row,) = json.loads((tmp_path / "decode_model.json").read_text())["results"]
    assert row["dtype"] == "gguf" and set(row["same_tokens"]) == {"attnlab gguf"}
    assert row["step_bytes"] > gguf_smollm2[0].weight_bytes() and row["step_bytes"] < 2 * gguf_smollm2[0].weight_bytes()


@pytest.mark.parametrize("command", ["check", "trace"])
def test_check_and_trace_read_a_layer_in_float32_and_say_why(served, capsys, command):
    checks = ["--checks", "parity_self"] if command == "check" else []
    assert main([command, "--model", "smollm2", "--layer", "0", *checks]) == 0
    assert served == [torch.float32]
    line = _weights_line(capsys.readouterr().err)
    assert line.startswith(
        f"attnlab: weights float32: {command}'s default for a real model's layer: its exact float weights "
        "(the GGUF blocks dequantized once at load); "
    )
    assert ("float64 reference" in line) is (command == "check")
