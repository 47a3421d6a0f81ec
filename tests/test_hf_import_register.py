"""``import attnlab`` is enough for ``attn_implementation="attnlab"``, and ``attnlab.hf.backends_used`` says what ran.

Each case runs in a fresh interpreter: whether transformers was imported before attnlab, after it, or the
automatic registration was turned off (``ATTNLAB_HF_AUTOREGISTER=0``, where transformers' own refusal comes back,
which shows the registration is what makes the name work).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SRC = str(Path(__file__).resolve().parents[1] / "src")

BUILD = """
import json, sys
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
try:
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="attnlab")
except Exception as err:
    print(json.dumps({"error": f"{type(err).__name__}: {err}"}))
    sys.exit(0)
import attnlab.hf
before = attnlab.hf.backends_used(model)
ids = torch.tensor([[1, 2, 3, 4]])
model(ids)
plain = attnlab.hf.backends_used(model)
model(ids, output_attentions=True)
weights = attnlab.hf.backends_used(model)
print(json.dumps({"before": before, "plain": plain, "weights": weights,
                  "attr": model.model.layers[1].self_attn.last_backend, **RESULT}))
"""


def _run(code: str, **env: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": SRC, **env},
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_attnlab_alone_makes_attn_implementation_attnlab_work_and_shows_the_backend():
    head = textwrap.dedent("""
        import sys
        import attnlab
        RESULT = {"transformers_imported_by_attnlab": "transformers" in sys.modules}
    """)
    got = _run(head + BUILD)
    assert got["transformers_imported_by_attnlab"] is False  # the registration waits: import attnlab stays light
    assert got["before"] == {}  # nothing ran yet
    layers = ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert got["plain"] == dict.fromkeys(layers, "sdpa")
    assert got["weights"] == dict.fromkeys(layers, "math")  # output_attentions=True: the weights come from math
    assert got["attr"] == "math"


@pytest.mark.slow  # a fresh interpreter importing transformers; the import-alone test stays quick
def test_transformers_imported_first_is_registered_at_import_attnlab():
    head = textwrap.dedent("""
        import transformers.modeling_utils
        import attnlab
        RESULT = {}
    """)
    got = _run(head + BUILD)
    assert got["plain"]["model.layers.0.self_attn"] == "sdpa"


@pytest.mark.slow  # a fresh interpreter importing transformers; the import-alone test stays quick
def test_without_the_automatic_registration_transformers_refuses_the_name():
    head = "import attnlab\nRESULT = {}\n"
    got = _run(head + BUILD, ATTNLAB_HF_AUTOREGISTER="0")
    assert "error" in got and "attnlab" in got["error"], got
