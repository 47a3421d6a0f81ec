"""``attnlab.hf.register()`` when transformers does not import: the real cause and its fix, for every way it fails.

Each failure is simulated in this process and undone by ``monkeypatch``: ``builtins.__import__``
raises a crafted error for ``transformers`` only, and ``importlib.metadata`` answers from a fake
table of installed distributions (so no case depends on what this venv holds). The errors are
raised from frames whose ``__name__`` is the module they pretend to be, and chained as
transformers chains them, so the diagnosis reads them as it reads real ones: a torchvision whose
import fails inside ``torch.library``, surfaced by transformers' lazy import as ``ModuleNotFoundError:
Could not import module 'AttentionInterface'. Are this object's requirements defined correctly?``.
"""

from __future__ import annotations

import builtins
import textwrap
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import pytest
from transformers import AttentionInterface

import attnlab.hf
from attnlab.runtime import import_advice
from attnlab.runtime.optional import import_failure

NEED = "attnlab.hf.register() needs transformers 5 (AttentionInterface and AttentionMaskInterface)"
SITE = "/venv/lib/python3.11/site-packages"
LAZY = (
    "Could not import module 'AttentionInterface'. Are this object's requirements defined correctly? Set the "
    "logging verbosity to DEBUG for the original import error."
)


class FakeDist:
    def __init__(self, version: str, requires: list[str]):
        self.version, self.requires = version, requires

    def locate_file(self, path: str) -> Path:
        return Path(SITE) / path


# what a CPU torch with PyPI's (CUDA) torchvision looks like
INSTALLED = {
    "transformers": FakeDist("5.24.0", ['torch>=2.6; extra == "torch"', 'torchvision; extra == "vision"']),
    "torch": FakeDist("2.13.0+cpu", []),
    "torchvision": FakeDist("0.28.0", ["numpy", "torch (==2.13.0)"]),
    "tokenizers": FakeDist("0.19.1", ["huggingface_hub"]),
}


@pytest.fixture
def installed(monkeypatch) -> dict[str, FakeDist]:
    """``importlib.metadata`` answering from a table the test may edit (a dict: name -> FakeDist)."""
    table = dict(INSTALLED)

    def dist(name: str) -> FakeDist:
        if name not in table:
            raise metadata.PackageNotFoundError(name)
        return table[name]

    monkeypatch.setattr(metadata, "version", lambda name: dist(name).version)
    monkeypatch.setattr(metadata, "requires", lambda name: dist(name).requires)
    monkeypatch.setattr(metadata, "distribution", dist)
    monkeypatch.setattr(metadata, "packages_distributions", lambda: {name: [name] for name in table})
    return table


def hop_in(module: str, body: str, path: str | None = None, **names: object) -> Callable[[], None]:
    """A function whose frame is ``module``'s (its ``__name__``, a file under site-packages) running ``body``."""
    path = path or f"{SITE}/{module.replace('.', '/')}.py"
    namespace: dict[str, object] = {"__name__": module, **names}
    exec(compile("def hop():\n" + textwrap.indent(body, "    "), path, "exec"), namespace)
    return namespace["hop"]  # type: ignore[return-value]


def caught(fn: Callable[[], object]) -> BaseException:
    try:
        fn()
    except BaseException as err:
        return err
    raise AssertionError("did not raise")


def lazily_surfaced(modules: list[str], root: BaseException) -> BaseException:
    """``root`` raised at the end of ``modules`` (each calls the next), re-raised by transformers' lazy
    ``__getattr__`` as its ModuleNotFoundError ``from`` the original, as transformers 5.24 does."""
    call = hop_in(modules[-1], "raise root", root=root)
    for module in reversed(modules[:-1]):
        call = hop_in(module, "nxt()", nxt=call)
    body = "try:\n    nxt()\nexcept Exception as e:\n    raise ModuleNotFoundError(msg) from e"
    return caught(hop_in("transformers.utils.import_utils", body, nxt=call, msg=LAZY))


TORCHVISION_BROKEN = [
    "transformers.modeling_utils",
    "transformers.image_utils",
    "torchvision",
    "torchvision._meta_registrations",
    "torch.library",
]


@pytest.fixture
def import_raises(monkeypatch) -> Callable[[BaseException], None]:
    """Make ``import transformers...`` (and only that) raise a given error."""

    def arm(err: BaseException) -> None:
        real = builtins.__import__

        def fake(name, *args, **kwargs):
            if name == "transformers" or name.startswith("transformers."):
                raise err
            return real(name, *args, **kwargs)

        monkeypatch.setattr(builtins, "__import__", fake)

    return arm


def register_error(import_raises, err: BaseException) -> ImportError:
    import_raises(err)
    with pytest.raises(ImportError) as info:
        attnlab.hf.register()
    assert info.value.__cause__ is err  # the original traceback stays one `raise ... from` away
    return info.value


def test_not_installed(installed, import_raises):
    del installed["transformers"]
    err = register_error(import_raises, ModuleNotFoundError("No module named 'transformers'", name="transformers"))
    assert str(err) == f"{NEED}, and transformers is not installed; install it with pip install 'transformers>=5'."


def test_too_old_names_the_installed_version(installed, import_raises):
    installed["transformers"] = FakeDist("4.57.1", [])
    root = ImportError(
        f"cannot import name 'AttentionMaskInterface' from 'transformers.masking_utils' ({SITE}/transformers/"
        "masking_utils.py)",
        name="transformers.masking_utils",
    )
    assert str(register_error(import_raises, root)) == (
        f"{NEED}, and transformers 4.57.1 is installed; upgrade it with pip install -U 'transformers>=5'."
    )


def test_broken_by_a_cuda_torchvision_under_a_cpu_torch(installed, import_raises):
    root = RuntimeError("operator torchvision::nms does not exist")
    err = register_error(import_raises, lazily_surfaced(TORCHVISION_BROKEN, root))
    assert str(err) == (
        f"{NEED}; transformers 5.24.0 is installed but failed to import (RuntimeError: operator torchvision::nms "
        "does not exist), inside torchvision (torchvision 0.28.0; raised in torch.library; transformers re-raised "
        "it as ModuleNotFoundError: Could not import module 'AttentionInterface'). torchvision 0.28.0 is the "
        "default index's build (CUDA, on Linux), but torch 2.13.0+cpu is a +cpu build: reinstall it from torch's "
        "index (pip install --force-reinstall --no-deps torchvision==0.28.0 --index-url "
        "https://download.pytorch.org/whl/cpu), or pip uninstall torchvision, and retry; reinstalling transformers "
        "would not help."
    )


def test_broken_by_a_torchvision_built_for_another_torch(installed, import_raises):
    installed["torchvision"] = FakeDist("0.27.0", ["torch (==2.12.0)"])
    installed["torch"] = FakeDist("2.13.0", [])
    root = ImportError("/venv/.../torchvision/_C.so: undefined symbol: _ZN3c1017RegisterOperators")
    err = register_error(import_raises, lazily_surfaced(TORCHVISION_BROKEN[:3], root))
    assert str(err).endswith(
        "inside torchvision (torchvision 0.27.0; transformers re-raised it as ModuleNotFoundError: Could not import "
        "module 'AttentionInterface'). torchvision 0.27.0 was built for torch 2.12.0, but torch 2.13.0 is "
        "installed: install the torchvision release paired with torch 2.13.0, or pip uninstall torchvision, and "
        "retry; reinstalling transformers would not help."
    )
    assert "(ImportError: /venv/.../torchvision/_C.so: undefined symbol" in str(err)


def test_broken_by_another_package(installed, import_raises):
    root = OSError("libtokenizers.so: cannot open shared object file")
    err = register_error(import_raises, lazily_surfaced(["transformers.tokenization_utils", "tokenizers"], root))
    assert str(err).endswith(
        "failed to import (OSError: libtokenizers.so: cannot open shared object file), inside tokenizers (tokenizers "
        "0.19.1; transformers re-raised it as ModuleNotFoundError: Could not import module 'AttentionInterface'). "
        "repair it (pip install --force-reinstall tokenizers) or uninstall it (pip uninstall tokenizers), and retry; "
        "reinstalling transformers would not help."
    )


def test_broken_by_a_local_folder_shadowing_a_package(installed, import_raises, tmp_path):
    shadow = str(tmp_path / "torchvision" / "__init__.py")
    local = hop_in("torchvision", "raise RuntimeError('half-written')", path=shadow)
    chained = caught(hop_in("transformers.image_utils", "nxt()", nxt=local))
    err = register_error(import_raises, chained)
    assert str(err) == (
        f"{NEED}; transformers 5.24.0 is installed but failed to import (RuntimeError: half-written), inside "
        f"torchvision, which is no installed package but {shadow}: a file or folder named torchvision shadows the "
        "real one, or is broken; rename or repair it, and retry."
    )


def test_an_error_of_transformers_own_is_quoted(installed, import_raises):
    root = ImportError(
        "tokenizers>=0.22.0,<=0.23.0 is required for a normal functioning of this module, but found tokenizers==0.19.1."
    )
    err = register_error(import_raises, lazily_surfaced(["transformers.dependency_versions_check"], root))
    assert str(err) == (
        f"{NEED}; transformers 5.24.0 is installed but failed to import (ImportError: tokenizers>=0.22.0,<=0.23.0 is "
        "required for a normal functioning of this module, but found tokenizers==0.19.1.), in the code of "
        "transformers itself (transformers.dependency_versions_check; transformers re-raised it as ModuleNotFoundError: Could not "
        "import module 'AttentionInterface'): that error names the fault (a dependency of transformers too old, "
        "say); fix it, or reinstall with pip install --force-reinstall 'transformers>=5', and retry."
    )


def test_attention_interface_missing_from_a_shadowing_file(installed, import_raises, tmp_path):
    shadow = str(tmp_path / "transformers.py")
    root = ImportError(f"cannot import name 'AttentionInterface' from 'transformers' ({shadow})", name="transformers")
    root.path = shadow  # as the import system sets it
    assert str(register_error(import_raises, root)) == (
        f"{NEED}; transformers 5.24.0 is installed, but transformers has no AttentionInterface (ImportError: cannot "
        f"import name 'AttentionInterface' from 'transformers' ({shadow})): that transformers is {shadow}, not the "
        f"installed one under {SITE}/transformers: a file or folder named transformers shadows it; rename it."
    )


def test_attention_interface_missing_from_the_installed_package(installed, import_raises):
    path = f"{SITE}/transformers/__init__.py"
    root = ImportError(f"cannot import name 'AttentionInterface' from 'transformers' ({path})", name="transformers")
    root.path = path
    assert str(register_error(import_raises, root)).endswith(
        "transformers has no AttentionInterface (ImportError: cannot import name 'AttentionInterface' from "
        f"'transformers' ({path})): this transformers build lacks it; reinstall a release with pip install "
        "--force-reinstall 'transformers>=5'."
    )


def test_metadata_without_its_module(installed, import_raises):
    err = register_error(import_raises, ModuleNotFoundError("No module named 'transformers'", name="transformers"))
    assert str(err) == (
        f"{NEED}; transformers 5.24.0 is installed by its metadata, but no module transformers is found (an "
        "interrupted install or uninstall); reinstall it with pip install --force-reinstall 'transformers>=5'."
    )


def test_an_interface_without_its_registry(monkeypatch):
    """A transformers whose AttentionInterface changed shape: one sentence, not an AttributeError."""
    monkeypatch.setattr(AttentionInterface, "_global_mapping", None)
    with pytest.raises(ImportError, match=r"needs transformers 5's AttentionInterface with register\(\) and its "):
        attnlab.hf.register()


def test_the_loaders_advice_reads_the_chain_too(installed):
    """import_advice (the model loaders') names the root error and the package entered, not the lazy wrapper."""
    err = lazily_surfaced(TORCHVISION_BROKEN, RuntimeError("operator torchvision::nms does not exist"))
    assert import_advice("transformers", "X needs transformers", err) == (
        "X needs transformers; transformers 5.24.0 is installed but failed to import (RuntimeError: operator "
        "torchvision::nms does not exist), which comes from 'torchvision', not from transformers: repair or "
        "uninstall that package (a torchvision built for another torch, say: pip uninstall torchvision) and retry."
    )
    assert import_failure("transformers", "X", ModuleNotFoundError("x", name="transformers"), min_major=5) == (
        "X; transformers 5.24.0 is installed by its metadata, but no module transformers is found (an interrupted "
        "install or uninstall); reinstall it with pip install --force-reinstall 'transformers>=5'."
    )
