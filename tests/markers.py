"""The test suite's own markers (`real`, `slow`; pyproject.toml registers them), read from a test
file's source without importing it: conftest.py skips importing a file whose module marks rule
out every test in it, and test_markers.py checks the `real` mark is where it must be."""

from __future__ import annotations

import ast
import itertools
import re

from _pytest.mark.expression import Expression

# How -m names a mark: pytest's own identifier characters.
_IDENT = re.compile(r"(?:\w|:|\+|-|\.|\[|\]|\\|/)+")


def is_mark(node: ast.AST, name: str | None = None) -> bool:
    """Whether `node` is `pytest.mark.<name>` (any name if None), called or not."""
    return (isinstance(node, ast.Attribute) and (name is None or node.attr == name)
            and isinstance(node.value, ast.Attribute) and node.value.attr == "mark"
            and isinstance(node.value.value, ast.Name) and node.value.value.id == "pytest")


def marks_in(node: ast.AST) -> set[str]:
    """The names of every `pytest.mark.<name>` inside `node`."""
    return {n.attr for n in ast.walk(node) if is_mark(n)}


def module_marks(tree: ast.Module) -> set[str]:
    """The marks a module's `pytestmark = ...` gives every test in it."""
    return set().union(*(marks_in(stmt.value) for stmt in tree.body
                         if isinstance(stmt, ast.Assign)
                         and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                 for t in stmt.targets)))


def rules_out_every_test(markexpr: str, marks: set[str]) -> bool:
    """Whether no test carrying `marks` (and maybe others of its own) can match `-m markexpr`."""
    expr = Expression.compile(markexpr)
    others = sorted(set(_IDENT.findall(markexpr)) - {"and", "or", "not"} - marks)
    for k in range(len(others) + 1):
        for extra in itertools.combinations(others, k):
            present = marks | set(extra)
            if expr.evaluate(lambda name, /, **kwargs: not kwargs and name in present):
                return False
    return True
