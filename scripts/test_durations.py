"""Write tests/durations.json: each test file's seconds in a junit XML of a `make test` run, longest first.

`make test` hands files to its two workers longest first (tests/conftest.py reads this file), so that no long file
is left to run alone at the end; a file missing from it runs after the listed ones. Regenerate it when files grow:

    env -u PYTHONDONTWRITEBYTECODE .venv/bin/python -m pytest -q -n 2 --dist loadfile -m "not slow" --junitxml=quick.xml
    python scripts/test_durations.py quick.xml
"""

from __future__ import annotations

import collections
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(xml_path: str) -> None:
    seconds: collections.Counter[str] = collections.Counter()
    for case in ET.parse(xml_path).iter("testcase"):
        seconds[case.get("classname", "").replace(".", "/") + ".py"] += float(case.get("time", 0))
    table = {name: round(s, 1) for name, s in seconds.most_common()}
    (ROOT / "tests" / "durations.json").write_text(json.dumps(table, indent=0) + "\n")
    print(f"wrote tests/durations.json: {len(table)} files, {sum(seconds.values()):.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
