"""Keep the packages' rooms small: `make lint` runs this.

Two limits, over every module of the four packages:

- no class longer than ``MAX_CLASS_LINES`` lines (from ``class`` to its last line);
- no function or method of cyclomatic complexity over ``MAX_COMPLEXITY``, as radon
  counts it (each branch, loop, ``except``, boolean operator and comprehension
  condition adds one).

A module that needs more is split by responsibility, not given an exception here.
Exit status 1 lists every place over a limit, one line each.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

from radon.complexity import cc_visit
from radon.visitors import Class

PACKAGES = ("app", "dataplane", "connector", "contract")
MAX_CLASS_LINES = 400
MAX_COMPLEXITY = 15


def _modules(root: Path) -> Iterator[Path]:
    for package in PACKAGES:
        yield from sorted((root / package).rglob("*.py"))


def _long_classes(source: str) -> Iterator[tuple[int, str, int]]:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > MAX_CLASS_LINES:
                yield node.lineno, node.name, lines


def _complex_functions(source: str) -> Iterator[tuple[int, str, int]]:
    # Functions and methods, each once (a class's own score sums its methods).
    for block in cc_visit(source):
        if not isinstance(block, Class) and block.complexity > MAX_COMPLEXITY:
            yield block.lineno, block.fullname, block.complexity


def problems(root: Path) -> list[str]:
    """Every place over a limit, as ``path:line: message``."""
    found = []
    for path in _modules(root):
        source = path.read_text()
        where = path.relative_to(root)
        for line, name, lines in _long_classes(source):
            found.append(
                f"{where}:{line}: class {name} is {lines} lines (at most {MAX_CLASS_LINES})"
            )
        for line, name, score in _complex_functions(source):
            found.append(
                f"{where}:{line}: {name} has cyclomatic complexity {score} "
                f"(at most {MAX_COMPLEXITY})"
            )
    return found


def main() -> int:
    found = problems(Path(__file__).resolve().parent.parent)
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
