"""The package's layering: imports only go down, and no two modules import each other.

Layers, lowest first:

0. ``core`` (the attention), ``runtime`` (devices, files, usage errors), ``quant`` (GGUF blocks and
   their kernels);
1. ``models``: the architectures, generation, and each family's weight map (pure names and layouts);
2. ``weight_files``: weight files read, checked and written, building the models below;
3. ``compat``, ``hf``, ``heads``, ``distributed``: attnlab's attention in other people's code and
   models, head inspection, context parallelism;
4. ``check`` and ``lab``, each on its own;
5. ``bench`` (the benchmarks, and llama.cpp as their peer);
6. ``tools``: the commands that read, run and debug (``generate``, ``trace``, ``inspect``, ``doctor``,
   and ``demo``, whose speed line runs ``bench``'s llama.cpp peer);
7. the package root (``attnlab``, ``attnlab.cli``, ``attnlab.__main__``).

A module may import from a lower layer or from its own subpackage. Every import counts: top-level,
inside functions, and under ``if TYPE_CHECKING:`` (an annotation that needs an upward import is a
design smell just the same).
"""

from __future__ import annotations

import ast
from pathlib import Path

import attnlab

PACKAGE_DIR = Path(attnlab.__file__).parent
LAYERS = {
    "runtime": 0,  # what every command shares about the machine (disks, locks, streams): below the kernels' build
    "core": 1,
    "quant": 1,
    "models": 2,
    "weight_files": 3,
    "compat": 4,
    "hf": 4,
    "heads": 4,
    "distributed": 4,
    "check": 5,
    "lab": 5,
    "bench": 6,
    "tools": 7,
}
ROOT_LAYER = 8  # attnlab/__init__.py, cli.py, __main__.py
# What reading or writing a file takes. A module of models/ that imports one of these, or makes one of
# FILE_CALLS, loads or saves weights, and belongs in weight_files/.
FILE_MODULES = frozenset(
    {
        "gguf",
        "huggingface_hub",
        "io",
        "json",
        "mmap",
        "os",
        "pathlib",
        "pickle",
        "safetensors",
        "shutil",
        "struct",
        "tempfile",
        "tokenizers",
        "transformers",
    }
)
FILE_CALLS = frozenset({"open", "torch.load", "torch.save", "np.memmap", "numpy.memmap", "np.fromfile", "np.load"})
FILE_METHODS = frozenset({"read_text", "read_bytes", "write_text", "write_bytes"})


def module_name(path: Path) -> str:
    parts = ("attnlab", *path.relative_to(PACKAGE_DIR).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package_dir: Path = PACKAGE_DIR) -> dict[str, set[str]]:
    """``{module: {attnlab modules it imports}}``, read from the source with ``ast``."""
    files = {module_name(p): p for p in package_dir.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.split(".")[0] == "attnlab")
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    source = ".".join([*base, node.module] if node.module else base)
                else:
                    source = node.module or ""
                if source.split(".")[0] != "attnlab":
                    continue
                targets.add(source)
                # `from . import functional` imports a module, not a name of the package
                targets.update(f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in files)
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def layer_of(module: str) -> tuple[int, str]:
    """``(layer, subpackage)`` of a dotted module name."""
    parts = module.split(".")
    sub = parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else ""
    return (LAYERS[sub], sub) if sub in LAYERS else (ROOT_LAYER, "<root>")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in graph.items():
        src_layer, src_sub = layer_of(src)
        for dst in targets:
            dst_layer, dst_sub = layer_of(dst)
            if dst_sub == src_sub:
                continue  # within one subpackage (or among the root's entry points); cycles are checked apart
            if dst_layer >= src_layer:
                bad.append(f"{src} (layer {src_layer}) imports {dst} (layer {dst_layer})")
    return sorted(bad)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph()
    assert "attnlab.core.functional" in graph["attnlab.core.dispatch"]  # `from . import functional`
    assert "attnlab.core.kv_cache" in graph["attnlab.check.adapters"]  # `from ..core.kv_cache import ...`
    assert "attnlab.lab.config" in graph["attnlab.bench.train"]  # an import inside a function
    assert len(graph) >= 40


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_imports_only_go_down():
    assert upward_imports(import_graph()) == []


def test_the_checks_catch_a_cycle_and_an_upward_import():
    fake = {
        "attnlab.core.attention": {"attnlab.core.interop"},
        "attnlab.core.interop": {"attnlab.core.attention"},
        "attnlab.core.masks": {"attnlab.models.gpt"},
        "attnlab.models.gpt": {"attnlab.core.masks"},
        "attnlab.lab.train": {"attnlab.check.suite"},
    }
    assert cycles(fake) == [
        ["attnlab.core.attention", "attnlab.core.interop"],
        ["attnlab.core.masks", "attnlab.models.gpt"],
    ]
    assert upward_imports(fake) == [
        "attnlab.core.masks (layer 1) imports attnlab.models.gpt (layer 2)",
        "attnlab.lab.train (layer 5) imports attnlab.check.suite (layer 5)",
    ]


def test_every_module_lives_in_a_layer():
    """New files go in a subpackage; only the entry points sit at the root."""
    roots = sorted(m for m in import_graph() if layer_of(m)[0] == ROOT_LAYER)
    assert roots == ["attnlab", "attnlab.__main__", "attnlab.cli"]


def file_access(source: str) -> list[str]:
    """What in ``source`` reads or writes files: each import of :data:`FILE_MODULES` and each call of
    :data:`FILE_CALLS` or :data:`FILE_METHODS`, by line, top-level or inside a function."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        elif isinstance(node, ast.Call):
            called = ast.unparse(node.func)
            if called in FILE_CALLS or called.rpartition(".")[2] in FILE_METHODS:
                found.append(f"line {node.lineno}: calls {called}()")
            continue
        else:
            continue
        found += [f"line {node.lineno}: imports {n}" for n in names if n.split(".")[0] in FILE_MODULES]
    return found


def test_models_hold_only_architectures_and_generation():
    """models/ builds and runs decoders from tensors, and maps each family's weight names onto them; reading
    or writing a weight file (JSON, safetensors, GGUF, memory maps, paths) is weight_files/' job."""
    models = sorted((PACKAGE_DIR / "models").glob("*.py"))
    assert {p.stem for p in models} >= {"config", "gpt", "llama", "llama_config", "generation", "weight_maps"}
    loaders = {f"models/{p.name}": found for p in models if (found := file_access(p.read_text()))}
    assert loaders == {}, "these read or write files: move them to weight_files/"


def test_the_file_check_sees_a_loader():
    """The check above cannot pass by seeing nothing: each loader that left models/ for weight_files/ is flagged."""
    for name in ("gguf", "file_checks", "pretrained", "saved_model", "hf_gpt2"):
        assert file_access((PACKAGE_DIR / "weight_files" / f"{name}.py").read_text()), name
    inside_a_function = "def load(path):\n    with open(path) as f:\n        return f.read()\n"
    assert file_access(inside_a_function) == ["line 2: calls open()"]
    assert file_access("def f(p):\n    return p.read_bytes()\n") == ["line 2: calls p.read_bytes()"]
    assert file_access("from safetensors.torch import load_file\n") == ["line 1: imports safetensors.torch"]
