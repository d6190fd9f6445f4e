"""The package layout is the architecture: these tests fail when an import runs the wrong way.

- the library imports nothing of the reference deployment or the dev tools;
- the core (everything but ``celery/``, ``cli/``, ``contrib/``, ``testing/``, the ``Outbox`` facade and
  the package ``__init__``) imports neither celery nor kombu;
- the reference deployment uses only ``celery_outbox``'s public names (``__all__``) and its contrib modules;
- the reference deployment's folders import only downward: ``relay/`` (the composition: its ``Outbox``,
  Celery app, WSGI entry, embedded broker) over ``orders/`` over ``consumers/`` over ``celeryconfig.py``;
- nothing below ``contrib/`` (everything but ``contrib/`` and the ``cli/`` entry point) names a contrib module,
  by an import or by a string (a ``sys.modules`` lookup, an ``import_module`` call, a table of names): a
  contrib plugs in from above, handing what it provides to the objects it builds.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import celery_outbox

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "celery_outbox"
DEPLOYMENT_TOP = ("orders", "relay", "consumers", "celeryconfig", "devtools", "chaos")
BINDING_DIRS = ("celery", "cli", "contrib", "testing")
BINDING_FILES = ("outbox.py", "__init__.py")


def imports(path: Path) -> Iterator[tuple[int, str, tuple[str, ...]]]:
    """(line, module, names) for every import statement, including ones inside functions."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, ()
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module, tuple(a.name for a in node.names)


def library_files() -> list[Path]:
    return sorted(LIBRARY.rglob("*.py"))


def is_core(path: Path) -> bool:
    rel = path.relative_to(LIBRARY)
    return rel.parts[0] not in BINDING_DIRS and str(rel) not in BINDING_FILES


def test_the_library_never_imports_the_deployment_or_dev_tools() -> None:
    bad = [f"{p.relative_to(ROOT)}:{line} imports {mod}" for p in library_files() for line, mod, _ in imports(p)
           if mod.split(".")[0] in DEPLOYMENT_TOP]
    assert bad == []


def test_the_core_imports_neither_celery_nor_kombu() -> None:
    core = [p for p in library_files() if is_core(p)]
    assert any(p.name == "dispatch.py" for p in core) and any(p.name == "handle.py" for p in core)
    bad = [f"{p.relative_to(ROOT)}:{line} imports {mod}" for p in core for line, mod, _ in imports(p)
           if mod.split(".")[0] in ("celery", "kombu", "amqp", "redis")]
    assert bad == []


def test_lower_layers_never_import_the_facade_or_the_cli() -> None:
    core = [p for p in library_files() if is_core(p)]
    bad = [f"{p.relative_to(ROOT)}:{line} imports {mod}" for p in core for line, mod, _ in imports(p)
           if mod in ("celery_outbox.outbox", "celery_outbox.cli") or mod.startswith(("celery_outbox.cli.",
                                                                                      "celery_outbox.contrib"))]
    assert bad == []


ABOVE_CONTRIB = ("contrib", "cli")
CONTRIB = "celery_outbox.contrib"


def below_contrib(path: Path) -> bool:
    return path.relative_to(LIBRARY).parts[0] not in ABOVE_CONTRIB


def code_strings(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of every string in ``path``'s code: documentation (a bare string statement) left out."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docs = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield node.lineno, node.value


def test_nothing_below_contrib_names_a_contrib_module() -> None:
    below = [p for p in library_files() if below_contrib(p)]
    assert any(p.name == "enqueue.py" for p in below) and any(p.name == "tasks.py" for p in below)
    bad = [f"{p.relative_to(ROOT)}:{line} imports {mod}" for p in below for line, mod, _ in imports(p)
           if mod.startswith(CONTRIB)]
    bad += [f"{p.relative_to(ROOT)}:{line} names {text[:60]!r}" for p in below for line, text in code_strings(p)
            if CONTRIB in text]
    assert bad == []


def test_a_contrib_module_named_in_a_string_is_caught(tmp_path: Path) -> None:
    # Given a module that finds a contrib module through sys.modules or import_module by its name
    sample = tmp_path / "sample.py"
    sample.write_text('"""Mentions celery_outbox.contrib.django in its docstring: fine."""\n'
                      'import importlib, sys\n'
                      'PROVIDERS = (("celery_outbox.contrib.django.enqueue", "atomic_writer"),)\n'
                      'found = sys.modules.get("celery_outbox.contrib.flask")\n'
                      'mod = importlib.import_module(f"celery_outbox.contrib.{found}")\n')
    # Then each of those strings is found, and the docstring is not
    assert sorted(line for line, text in code_strings(sample) if CONTRIB in text) == [3, 4, 5]


def deployment_files() -> list[Path]:
    files = [ROOT / "celeryconfig.py"]
    for top in ("orders", "relay", "consumers"):
        files += sorted((ROOT / top).rglob("*.py"))
    return files


def test_the_deployment_uses_only_the_public_api() -> None:
    public = set(celery_outbox.__all__)
    bad = []
    for p in deployment_files():
        for line, mod, names in imports(p):
            where = f"{p.relative_to(ROOT)}:{line}"
            if mod == "celery_outbox":
                bad += [f"{where} imports non-public {n}" for n in names if n not in public]
            elif mod.startswith("celery_outbox.") and not mod.startswith("celery_outbox.contrib."):
                bad.append(f"{where} imports {mod}")
    assert bad == []


# The reference deployment's floors, top first: each may import the ones after it, never one before it.
DEPLOYMENT_FLOORS = ("relay", "orders", "consumers", "celeryconfig")


def upward_imports(files: list[Path], root: Path) -> list[str]:
    """Every import in ``files`` (``<floor>/...`` or ``<floor>.py`` under ``root``) of a higher floor."""
    floor = {name: i for i, name in enumerate(DEPLOYMENT_FLOORS)}
    bad = []
    for p in files:
        rel = p.relative_to(root)
        own = floor[rel.parts[0].removesuffix(".py")]
        bad += [f"{rel}:{line} imports {mod}" for line, mod, _ in imports(p)
                if floor.get(mod.split(".")[0], own) < own]
    return bad


def test_the_deployment_imports_only_downward() -> None:
    files = deployment_files()
    assert {p.relative_to(ROOT).parts[0].removesuffix(".py") for p in files} == set(DEPLOYMENT_FLOORS)
    assert upward_imports(files, ROOT) == []


def test_an_upward_import_in_the_deployment_is_caught(tmp_path: Path) -> None:
    # Given a consumer that reaches up into orders (even inside a function) and orders reaching up into relay
    (tmp_path / "consumers").mkdir()
    (tmp_path / "orders").mkdir()
    up = tmp_path / "consumers" / "models.py"
    up.write_text("import celeryconfig\n\ndef base():\n    from orders.models import Base\n    return Base\n")
    web = tmp_path / "orders" / "web.py"
    web.write_text("from consumers.models import Base\nimport relay.factory\n")
    # Then both upward imports are found, and the downward ones are not
    assert upward_imports([up, web], tmp_path) == ["consumers/models.py:4 imports orders.models",
                                                   "orders/web.py:2 imports relay.factory"]


def test_every_public_name_exists() -> None:
    missing = [n for n in celery_outbox.__all__ if not hasattr(celery_outbox, n)]
    assert missing == []
    assert len(set(celery_outbox.__all__)) == len(celery_outbox.__all__)
