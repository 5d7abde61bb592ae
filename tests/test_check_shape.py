"""scripts/check_shape.py, which `make lint` runs: it finds what is over its limits."""

from __future__ import annotations

from pathlib import Path

from scripts import check_shape


def _package(tmp_path: Path, source: str) -> Path:
    for name in check_shape.PACKAGES:
        (tmp_path / name).mkdir()
    (tmp_path / "app" / "mod.py").write_text(source)
    return tmp_path


def test_a_long_class_is_named(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(check_shape.MAX_CLASS_LINES))
    root = _package(tmp_path, f"class Big:\n{body}\n\nclass Small:\n    x = 1\n")
    (found,) = check_shape.problems(root)
    assert found.startswith("app/mod.py:1: class Big is 401 lines")


def test_a_complex_method_is_named_once(tmp_path: Path) -> None:
    branches = "".join(f"        if x == {i}:\n            return {i}\n" for i in range(16))
    root = _package(tmp_path, f"class C:\n    def f(self, x):\n{branches}        return -1\n")
    (found,) = check_shape.problems(root)
    assert found == "app/mod.py:2: C.f has cyclomatic complexity 17 (at most 15)"
