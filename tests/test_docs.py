"""README.md and docs/: generated pages are fresh, and what they quote matches its owner.

- docs/reference.md is what scripts/gen_reference.py renders from the settings and
  the metrics (like openapi/openapi.json and tests/app/test_openapi.py);
- docs/benchmarks.md names, for every figure, a bench script that exists, flags that
  script accepts and a figure it prints, with numbers in its ``result:`` format;
- docs/connector.md's key table lists exactly the keys connector/config.py reads,
  with its defaults;
- the README stays a front door (under 15 KB, the two commands) and every relative
  link in it and in docs/ leads somewhere.
"""

from __future__ import annotations

import ast
import re
import shlex
from functools import cache
from pathlib import Path

import pytest
from pydantic import AliasChoices

from bench.common import RESULT_LINE, Rounds, result_line, results
from connector.config import KNOWN_KEYS, ConnectorConfig
from scripts.gen_reference import TARGET, render
from tests.support import ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"
BENCHMARKS = DOCS / "benchmarks.md"
PAGES = [README, *sorted(DOCS.glob("*.md"))]


def test_reference_page_is_in_sync() -> None:
    assert TARGET.read_text() == render(), "docs/reference.md is stale: run `make docs`"


def test_reference_lists_every_setting_and_metric() -> None:
    page = TARGET.read_text()
    for flag in ("`--chunk-size`", "`MPCACHE_CHUNK_SIZE`", "`--no-pool-prefault`"):
        assert flag in page
    for metric in ("`mpcache_chunks_hit_total`", "`mpcache_http_request_duration_seconds`"):
        assert metric in page


# ------------------------------------------------------------------------ README


def test_readme_is_a_front_door_that_gives_the_two_commands() -> None:
    text = README.read_text()
    assert len(text.encode()) < 15_000, f"README.md is {len(text.encode())} bytes"
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    commands = [line.split("#")[0].strip() for block in blocks for line in block.splitlines()]
    assert "make serve" in commands and "make test" in commands
    assert "make test" in (ROOT / ".ci" / "run").read_text()  # what CI runs is that command


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = page.read_text()
    headings = re.findall(r"^#+ (.+)$", text, re.M)
    return {_slug(h) for h in headings} | set(re.findall(r'<a id="([^"]+)">', text))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.exists(), f"{page.name}: {target} does not exist"
        if anchor and resolved.suffix == ".md":
            assert anchor in _anchors(resolved), f"{page.name}: no anchor {target}"


# -------------------------------------------------------------------- benchmarks


def _rows(page: Path, header: str) -> list[list[str]]:
    """The cells of each row of the table whose header row starts with ``header``."""
    lines = page.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return rows


def _code(cell: str) -> str:
    match = re.fullmatch(r"`([^`]+)`", cell)
    assert match, f"expected one code span, got {cell!r}"
    return match.group(1)


@cache
def _module(script: Path) -> ast.Module:
    return ast.parse(script.read_text())


def _figures(script: Path) -> tuple[str, ...]:
    """The script's module-level ``FIGURES`` tuple, read without importing it."""
    for node in _module(script).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "FIGURES" for t in node.targets
        ):
            value = ast.literal_eval(node.value)
            assert isinstance(value, tuple) and all(isinstance(v, str) for v in value)
            return value
    raise AssertionError(f"{script.name} declares no FIGURES")


def _flags(script: Path) -> set[str]:
    """Every option the script's argument parser declares."""
    flags = {"-h", "--help"}
    for node in ast.walk(_module(script)):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_argument"
        ):
            continue
        names = [a.value for a in node.args if isinstance(a, ast.Constant)]
        flags |= {n for n in names if isinstance(n, str) and n.startswith("-")}
        negatable = any(
            isinstance(k.value, ast.Attribute) and k.value.attr == "BooleanOptionalAction"
            for k in node.keywords
            if k.arg == "action"
        )
        if negatable:
            flags |= {"--no-" + n.removeprefix("--") for n in names if isinstance(n, str)}
    return flags


BENCH_ROWS = _rows(BENCHMARKS, "| figure | command |")


def test_benchmarks_page_has_rows() -> None:
    assert len(BENCH_ROWS) >= 10
    assert all(len(row) == 7 for row in BENCH_ROWS), [r for r in BENCH_ROWS if len(r) != 7]


@pytest.mark.parametrize("row", BENCH_ROWS, ids=lambda row: row[0].strip("`"))
def test_benchmark_row_names_a_figure_its_bench_prints(row: list[str]) -> None:
    figure, command, _unit, median, spread, over, measured = row
    figure = _code(figure)
    python, script_name, *args = shlex.split(_code(command))
    assert python == ".venv/bin/python"
    script = ROOT / script_name
    assert script.parent == ROOT / "bench" and script.is_file(), script_name
    for arg in args:
        if arg.startswith("-"):
            assert arg.split("=")[0] in _flags(script), f"{script_name} has no option {arg}"
    assert figure in _figures(script), f"{script_name} does not print {figure!r}"
    # The numbers, in the bench's own result-line format ("—": not recorded).
    assert (median, spread) != ("—", "—")
    line = f"result: {figure} = {median} ({spread}) over {over.split()[0]} rounds"
    if "—" not in (median, spread):
        match = RESULT_LINE.fullmatch(line)
        assert match, line
        assert float(match["low"]) <= float(match["median"]) <= float(match["high"]), line
    else:
        number = r"[0-9.]+"
        assert re.fullmatch(number, median) or re.fullmatch(rf"{number}-{number}", spread), row
    assert re.fullmatch(r"[0-9]+ (runs|rounds)|several runs", over), over
    assert re.match(r"20\d\d-\d\d-\d\d, ", measured), measured


def _device(script: Path) -> str | None:
    """The script's module-level ``DEVICE`` (hardware it needs), read without importing it."""
    for node in _module(script).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "DEVICE" for t in node.targets
        ):
            value = ast.literal_eval(node.value)
            assert isinstance(value, str)
            return value
    return None


def test_every_bench_has_a_row() -> None:
    """Every bench has rows, but one that needs a GPU (``DEVICE = "cuda"``) may wait
    for one: the page names it where it says which benches wait (never a row
    without figures)."""
    named = {shlex.split(_code(row[1]))[1] for row in BENCH_ROWS}
    scripts = {f"bench/{p.name}" for p in (ROOT / "bench").glob("*_bench.py")}
    waiting = {s for s in scripts - named if _device(ROOT / s) == "cuda"}
    assert named <= scripts and scripts - named == waiting, (scripts ^ named) - waiting
    page = BENCHMARKS.read_text()
    assert not waiting or "## Waiting for a GPU" in page
    for script in waiting:
        assert f"`{script}`" in page.split("## Waiting for a GPU", 1)[-1], script
    for script in scripts:
        assert _figures(ROOT / script)  # and each declares its figures


def test_result_lines_are_in_the_format_the_page_is_checked_against() -> None:
    rounds = Rounds()
    for value, base in ((1.0, 2.0), (3.0, 2.0), (2.0, 2.0)):
        rounds.add("a", value)
        rounds.add("b", base)
    lines = results(["a / b", "a", "c / b"], rounds).splitlines()
    assert lines == [
        "result: a / b = 1.00 (0.50-1.50) over 3 rounds",
        "result: a = 2.00 (1.00-3.00) over 3 rounds",
        "result: c / b not measured",
    ]
    assert all(RESULT_LINE.fullmatch(line) for line in lines[:2])
    single = result_line("slowest GET /health during a 20 MB body", [150.4], 0)
    assert single == "result: slowest GET /health during a 20 MB body = 150 (150-150) over 1 round"
    assert RESULT_LINE.fullmatch(single)


# --------------------------------------------------------------------- connector


def _key_fields() -> dict[str, str]:
    """Each extra-config key and the ConnectorConfig field it sets."""
    fields = {}
    for name, field in ConnectorConfig.model_fields.items():
        if isinstance(field.validation_alias, AliasChoices):
            for alias in field.validation_alias.choices:
                fields[str(alias)] = name
    return fields


def test_connector_key_table_matches_the_config_module() -> None:
    rows = _rows(DOCS / "connector.md", "| key | default |")
    documented = {key for row in rows for key in re.findall(r"`([a-z_.]+)`", row[0])}
    assert documented == KNOWN_KEYS, documented ^ KNOWN_KEYS
    fields = _key_fields()
    for keys, shown, _ in rows:
        first = re.findall(r"`([a-z_.]+)`", keys)[0]
        default = ConnectorConfig.model_fields[fields[first]].default
        if isinstance(default, bool):
            assert shown == str(default).lower(), (first, shown)
        elif isinstance(default, float):
            assert shown == f"{default:g}", (first, shown)
        elif isinstance(default, tuple):
            assert all(f"`{url}`" in shown for url in default), (first, shown)
