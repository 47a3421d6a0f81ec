"""scripts/gpu_check.py's suite step: the junit XML of a device-suite run read back into its table."""

from __future__ import annotations

from conftest import load_script

XML = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
  <testcase classname="tests.test_masks" name="test_a" time="0.1"/>
  <testcase classname="tests.test_masks" name="test_b[cuda]" time="0.1">
    <failure message="AssertionError: dq: 256 non-finite&#10;second line">trace</failure>
  </testcase>
  <testcase classname="tests.test_numerics" name="test_c" time="0.1"><skipped message="no float64"/></testcase>
  <testcase classname="tests.test_numerics" name="test_d" time="0.1"><error message="RuntimeError: boom"/></testcase>
</testsuite></testsuites>
"""


def test_suite_table_counts_each_file_and_lists_every_failure_with_its_first_line(tmp_path):
    gpu_check = load_script("gpu_check")
    xml = tmp_path / "suite.xml"
    xml.write_text(XML)
    table, summary = gpu_check.suite_table(xml, "cuda")
    assert summary == "1 passed, 2 failed, 1 skipped"
    assert "| test_masks.py | 1 | 1 | 0 |" in table and "| test_numerics.py | 0 | 1 | 1 |" in table
    assert "- `test_masks.py::test_b[cuda]`: AssertionError: dq: 256 non-finite" in table
    assert "second line" not in table and "- `test_numerics.py::test_d`: RuntimeError: boom" in table


def test_the_suite_files_exist_and_the_device_files_take_the_device():
    """Every file the GPU run lists is in tests/, and each one listed as a device file has tests that take the
    `device` fixture, so that the run tests the GPU where its table says it does."""
    import re

    gpu_check = load_script("gpu_check")
    for name in gpu_check.SUITE_FILES:
        assert (gpu_check.REPO / "tests" / name).is_file(), name
    for name in gpu_check.DEVICE_FILES:
        text = (gpu_check.REPO / "tests" / name).read_text()
        assert re.search(r"def test_\w+\([^)]*\bdevice(_with_float64)?\b", text), name
