"""Write docs/check_gallery.md and its Chinese twin docs/check_gallery.zh.md from the catalogue of mistakes
(attnlab.check.catalogue), with the modules of tests/mistake_corpus/ that make each one.

    python scripts/check_gallery.py

The Chinese page is written here, not translated from the English one: its prose is Chinese, what
``attnlab check`` prints (what it says, the fix) stays as the terminal shows it, and each mistake's failing rows
come from :data:`SYMPTOMS_ZH`; a mistake whose rows have no Chinese there stops the script, which names it.
tests/test_check_diagnosis.py fails when the English page and the catalogue differ, tests/test_generated_zh.py
when the Chinese page and this script's do.
"""

import re
import sys
from pathlib import Path

from attnlab.check.catalogue import MISTAKES, gallery_markdown

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


# ---- the Chinese page -------------------------------------------------------------------------------

ZH_INTRO = """# `attnlab check` 能指出的错误 {{#the-mistakes-attnlab-check-names}}

由 `python scripts/check_gallery.py` 从 `attnlab.check.catalogue.MISTAKES` 生成；两者不一致时 `tests/test_check_diagnosis.py` 会失败。消息按博文 000 的尺寸填写（embed_dim 64，8 个 8 维的头），保持 check 实际打印的英文原文，方便与终端输出对照。每种错误的识别方式：*带着这个错误重新计算*（在模块自己的权重和输入上带着这个错误重新计算输出，结果吻合）、*直接探测*（直接测试某种行为）或*它抛出的异常*（它抛出的消息）。

*加固提示*（hardening note）指的是教科书式的模块本来就不为之设计的健壮性：模块正确地计算了注意力，检查通过（退出码 0），并打印这条提示及其修复方法；`--strict` 会把它变成失败。

共 {count} 种错误。`tests/mistake_corpus/` 中的每个模块犯其中一种（或者一种都不犯），并且必须被第一个指出来。
"""

HOW_ZH = {"recomputed with the mistake": "带着这个错误重新计算", "probed": "直接探测", "its exception": "它抛出的异常"}

# Each mistake's failing rows, in Chinese. A symptom that only names rows (``determinism, dropout_off_in_eval``)
# needs no entry: the names stay, joined by 、.
SYMPTOMS_ZH = {
    "every output row (parity, masks, fully masked rows, dropout)": "每个输出行（一致性、掩码、整行被遮住、dropout）",
    "every output row": "每个输出行",
    "masked parity, no causal leak, padding invariance": "带掩码的一致性、无因果泄漏、填充不变性",
    "every masked row, no causal leak, padding invariance": "每个带掩码的行、无因果泄漏、填充不变性",
    "mask_semantics (the checks then pass float masks)": "mask_semantics（之后的检查改传 float 掩码）",
    "every masked row": "每个带掩码的行",
    "no_causal_leak, causal parity, KV cache": "no_causal_leak、因果一致性、KV 缓存",
    "causal parity, KV cache": "因果一致性、KV 缓存",
    "no_causal_leak, causal parity": "no_causal_leak、因果一致性",
    "padding parity, padding_invariance": "填充一致性、padding_invariance",
    "padding parity, padding_invariance, masked rows": "填充一致性、padding_invariance、带掩码的行",
    "every output row, permutation_equivariance": "每个输出行、permutation_equivariance",
    "every output row; masked rows raise (the masks' shapes no longer fit)": "每个输出行；带掩码的行抛出异常（掩码的形状不再匹配）",
    "every output row (and dropout_rate, whose contexts are V)": "每个输出行（以及 dropout_rate，它的上下文就是 V）",
    "gradcheck rows": "gradcheck 各行",
    "low_precision rows": "low_precision 各行",
    "mask_semantics (the checks then pass masks in the module's own reading)": "mask_semantics（之后的检查按模块自己的理解传入掩码）",
    "every row (the module raises)": "每一行（模块抛出异常）",
    "parity_cross and the other cross-attention rows": "parity_cross 以及其他交叉注意力行",
    "low_precision[fp16] rows": "low_precision[fp16] 各行",
    "every row with a backward pass": "每个有反向传播的行",
    "masked rows": "带掩码的行",
    "every row that builds it, on a GPU (attnlab check --device cuda)": "在 GPU 上构建它的每一行（`attnlab check --device cuda`）",
}
ROW_NAMES = re.compile(r"[a-z_]+(?:\[\w]+\])?(?:, [a-z_]+(?:\[\w]+\])?)*")


def symptom_zh(mistake: str, symptom: str) -> str:
    """A mistake's failing rows in Chinese; SystemExit naming the mistake when :data:`SYMPTOMS_ZH` lacks them."""
    if symptom in SYMPTOMS_ZH:
        return SYMPTOMS_ZH[symptom]
    if ROW_NAMES.fullmatch(symptom):
        return "、".join(symptom.split(", "))
    raise SystemExit(
        f"scripts/check_gallery.py: mistake {mistake!r} fails {symptom!r}, which SYMPTOMS_ZH does not say in Chinese; "
        f"add it there, then rerun."
    )


def seed_zh(seed: str) -> str:
    """Where the posts discuss a mistake, as the Chinese pages name the posts: 博文 002 第 2.3 节."""
    m = re.fullmatch(r"seed (\d{3}), sections? ([\d.]+)(?: and ([\d.]+))?", seed)
    if m:
        return f"博文 {m[1]} 第 {m[2]}{'、' + m[3] if m[3] else ''} 节"
    m = re.fullmatch(r"beyond the seeds: rotary position embeddings \((.+), section ([\d.]+)\)", seed)
    if m:
        return f"博文之外：旋转位置编码（{m[1]}，第 {m[2]} 节）"
    m = re.fullmatch(r"beyond the seeds: ALiBi, attention with linear biases \((.+), section ([\d.]+)\)", seed)
    if m:
        return f"博文之外：ALiBi，线性偏置注意力（{m[1]}，第 {m[2]} 节）"
    raise SystemExit(f"scripts/check_gallery.py: no Chinese for where {seed!r} points; add it to seed_zh.")


def posts_zh(text: str) -> str:
    """``text`` with the posts named as the Chinese pages name them (博文 000, never "seed", which reads as a
    random seed in Chinese)."""
    return re.sub(r"\bseed (\d{3})\b", r"博文 \1", text)


def gallery_markdown_zh(examples: dict[str, list[str]]) -> str:
    """docs/check_gallery.zh.md: :func:`gallery_markdown`'s page, entry by entry, with the Chinese page's words: its
    own introduction, each field's label and value in Chinese where they are prose, what check prints as it prints
    it. A field the English page gains without a Chinese label here stops the script, naming it."""
    english = gallery_markdown(examples)
    lines = [ZH_INTRO.format(count=len(MISTAKES))]
    mistake = ""
    for line in english[english.index("\n## ") + 1 :].splitlines():
        field = re.fullmatch(r"- \*\*(.+?):\*\* (.*)", line)
        if line.startswith("## `"):
            mistake = line[4:-1]
            lines.append(f"{line} {{#{mistake}}}")
        elif field is None:
            lines.append(line)
        elif field[1] not in FIELDS_ZH:
            raise SystemExit(
                f"scripts/check_gallery.py: the gallery's field {field[1]!r} has no Chinese label in FIELDS_ZH."
            )
        else:
            label, say = FIELDS_ZH[field[1]]
            lines.append(f"- **{label}**：{say(mistake, field[2])}")
    return "\n".join(lines) + "\n" * english.endswith("\n")


# each field of an English entry: its Chinese label, and its value in Chinese (given the mistake's id)
FIELDS_ZH = {
    "check says": ("check 的说法", lambda _, text: posts_zh(text)),
    "rows that fail": ("失败的行", symptom_zh),
    "recognised by": ("识别方式", lambda _, how: HOW_ZH[how]),
    "verdict": ("结论", lambda _, __: "加固提示（检查通过；`--strict` 时失败）"),
    "fix": ("修复", lambda _, text: posts_zh(text)),
    "see": ("出处", lambda _, where: seed_zh(where)),
    "written wrong in": ("错误写法见", lambda _, files: files),
}


def main() -> int:
    examples = corpus_examples()
    for name, text in (
        ("check_gallery.md", gallery_markdown(examples)),
        ("check_gallery.zh.md", gallery_markdown_zh(examples)),
    ):
        out = ROOT / "docs" / name
        out.write_text(text, encoding="utf-8")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
