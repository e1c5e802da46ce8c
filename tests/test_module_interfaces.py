"""Every module of fedlightning declares ``__all__``, and its other modules import only names in it.

``__all__`` is a module's interface: the names it offers to the rest of the package (underscored ones are the
internals of a subpackage, e.g. the vectorised engine's, which its sibling modules share). The layer order and the
absence of import cycles are checked by ``lint-imports`` (the contracts in pyproject.toml, run by ``.ci/run``);
these tests check what import-linter does not: which *names* cross a module boundary.
"""

import ast
import importlib
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "fedlightning"
FILES = sorted(PACKAGE.rglob("*.py"))


def module_name(path: pathlib.Path, root: pathlib.Path = PACKAGE.parent) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def declared_all(path: pathlib.Path):
    """The literal ``__all__`` assigned at module level, or None."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return ast.literal_eval(node.value)
    return None


def imported_names(path: pathlib.Path, root: pathlib.Path = PACKAGE.parent):
    """``(line, module, name)`` of every ``from <fedlightning module> import name`` in ``path`` (module level,
    inside functions and under TYPE_CHECKING alike), relative imports resolved; ``root`` holds the package."""
    me = module_name(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        if module == "fedlightning" or module.startswith("fedlightning."):
            for alias in node.names:
                yield node.lineno, module, alias.name


@pytest.mark.parametrize("path", FILES, ids=lambda p: module_name(p))
def test_every_module_declares_all_and_defines_its_names(path):
    names = declared_all(path)
    assert isinstance(names, list), f"{module_name(path)} declares no literal __all__ list"
    assert len(names) == len(set(names)) and all(isinstance(n, str) for n in names)
    if path.name == "__main__.py":  # running it is its only purpose (python -m)
        assert names == []
        return
    module = importlib.import_module(module_name(path))
    missing = [n for n in names if not hasattr(module, n)]
    assert not missing, f"{module_name(path)}.__all__ names what it does not define: {missing}"


def test_modules_import_only_names_in_each_others_all():
    interfaces = {module_name(p): declared_all(p) or [] for p in FILES}
    outside = []
    for path in FILES:
        for line, module, name in imported_names(path):
            if f"{module}.{name}" in interfaces:  # a submodule
                continue
            if name not in interfaces.get(module, []):
                outside.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {name} from {module}")
    assert not outside, "imports of names outside the module's __all__:\n" + "\n".join(outside)


def test_the_check_sees_a_name_outside_all(tmp_path):
    """The import scan resolves relative imports and finds names that are not in the target's __all__."""
    pkg = tmp_path / "fedlightning" / "sub"
    pkg.mkdir(parents=True)
    src = pkg / "a.py"
    src.write_text("def f():\n    from .b import hidden, shown\n    from fedlightning.sub.c import other\n")
    found = sorted((module, name) for _, module, name in imported_names(src, tmp_path))
    assert found == [("fedlightning.sub.b", "hidden"), ("fedlightning.sub.b", "shown"), ("fedlightning.sub.c", "other")]
