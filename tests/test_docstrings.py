"""The packages' docstrings keep one dialect: no Sphinx roles, tensor shapes written as tuples."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(p for pkg in ("lime_probe", "lime_model") for p in (ROOT / pkg).rglob("*.py"))
ROLE = re.compile(r":(?:class|func|mod|meth|attr|data|obj|exc|ref|py:\w+):`")
# a bracketed list opening a code span or following a name in one (``C [n, kv, S]``) is a shape when one of
# its entries is a one-letter or numeric dimension or a product; lists of names (``[name, size]``) are not
BRACKETED = re.compile(r"(`+)(?:[A-Za-z_]\w* )?\[([\w*+ ]+(?:, *[\w*+ .]+)+)\]\1")
DIMENSION = re.compile(r"^(?:[A-Za-z]|\d+|.*\*.*)$")
# the K/V buffer's modules write its memory layouts (not shapes) in brackets, as the architecture notes say
LAYOUTS = {
    ROOT / "lime_model" / "kv_buffer.py",
    ROOT / "lime_model" / "kv_kernels.py",
    ROOT / "lime_model" / "kv_read.py",
}


def docstrings(path: Path) -> list[tuple[int, str]]:
    nodes = [
        n
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
    ]
    return [(getattr(n, "lineno", 1), doc) for n in nodes if (doc := ast.get_docstring(n, clean=False))]


def bracket_shapes(text: str) -> list[str]:
    return [
        m.group(0)
        for m in BRACKETED.finditer(text)
        if any(DIMENSION.match(d.strip()) for d in m.group(2).split(","))
    ]


def test_the_checks_see_both_packages_and_catch_what_they_look_for():
    assert len(SOURCES) > 50
    assert ROLE.search("see :func:`lime_probe.extract`") and ROLE.search(":class:`~a.B`")
    assert not ROLE.search("see ``lime_probe.extract``")
    assert bracket_shapes("`[B, T, hidden]`, ``C [n, kv, S]``") == ["`[B, T, hidden]`", "``C [n, kv, S]``"]
    assert bracket_shapes("a ``weight [kv, S*kv]``") == ["``weight [kv, S*kv]``"]
    for fine in (
        "``C (n, kv, S)``",
        "``dict[str, Any]``",
        "``C[m, h, p]``",
        '``["a", "b"]``',
        "`[name, size]`",
    ):
        assert not bracket_shapes(fine), fine


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_sphinx_roles(path):
    hits = [
        f"{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1) if ROLE.search(line)
    ]
    assert not hits, "Sphinx roles (write the name in plain backticks):\n" + "\n".join(hits)


@pytest.mark.parametrize(
    "path", [p for p in SOURCES if p not in LAYOUTS], ids=lambda p: str(p.relative_to(ROOT))
)
def test_tensor_shapes_are_tuples(path):
    hits = [f"{line}: {shape}" for line, doc in docstrings(path) for shape in bracket_shapes(doc)]
    assert not hits, "shapes in brackets (write them as tuples, ``(B, T, hidden)``):\n" + "\n".join(hits)
