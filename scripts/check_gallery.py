"""Write docs/check_gallery.md from the catalogue of mistakes (attnlab.check.catalogue), with the
modules of tests/mistake_corpus/ that make each one.

    python scripts/check_gallery.py

tests/test_check_diagnosis.py fails when the file and the catalogue differ.
"""

import re
from pathlib import Path

from attnlab.check.catalogue import gallery_markdown

ROOT = Path(__file__).resolve().parent.parent


def corpus_examples(root: Path = ROOT) -> dict[str, list[str]]:
    """Mistake id -> the corpus files whose EXPECTED (or ALSO) names it, read as text (nothing imported)."""
    found: dict[str, list[str]] = {}
    for path in sorted((root / "tests" / "mistake_corpus").glob("*.py")):
        text = path.read_text()
        ids = re.findall(r'^EXPECTED = "(\w+)"', text, re.M) + re.findall(
            r'"(\w+)"', "".join(re.findall(r"^ALSO = \[(.*)\]", text, re.M))
        )
        for i in ids:
            found.setdefault(i, []).append(str(path.relative_to(root)))
    return found


if __name__ == "__main__":
    out = ROOT / "docs" / "check_gallery.md"
    out.write_text(gallery_markdown(corpus_examples()))
    print(f"wrote {out}")
