"""The docs are checked against the code they describe, and the repository stands alone.

- docs/configuration.md lists every field of the orchestrator's config models (recursively), no
  field that does not exist, each with the model's default; its flag table matches the CLI parser.
- Every example config in docs/examples/ loads and validates with the orchestrator's own loader.
- Every relative link (and its #anchor) in README.md and docs/ points at something in the repository,
  and every module path the docs name exists.
- Nothing refers to the sibling ``shared`` directory of the workspace, or to the PROTOCOL.md that lived there.
"""

from __future__ import annotations

import argparse
import logging
import re
import typing
from pathlib import Path
from typing import Any

import pytest

pydantic = pytest.importorskip("pydantic")
yaml = pytest.importorskip("yaml")

from server.orchestrator import cli as orchestrator_cli  # noqa: E402
from server.orchestrator.config import (  # noqa: E402
    OrchestratorConfig,
    build_config,
    load_config_file,
)

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CONFIGURATION = DOCS / "configuration.md"
EXAMPLES = DOCS / "examples"
CONFIG_LOGGER = "fastcore.orchestrator"

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
_MODEL_HEADING = re.compile(r"\(model `(\w+)`\)\s*$")
_BACKTICKED = re.compile(r"`([^`]+)`")


# -- markdown helpers -----------------------------------------------------------------------------


def without_code_blocks(text: str) -> str:
    """``text`` with fenced code blocks blanked (a ``# comment`` in one is no heading, a link no link)."""
    return _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, body up to the next heading) for every heading outside code blocks."""
    text = without_code_blocks(text)
    matches = list(_HEADING.finditer(text))
    return [
        (m.group(2), text[m.end() : matches[i + 1].start() if i + 1 < len(matches) else len(text)])
        for i, m in enumerate(matches)
    ]


def first_table(body: str) -> list[dict[str, str]]:
    """The rows of the first markdown table in ``body``, as {column name: cell}."""
    lines = [line.strip() for line in body.splitlines()]
    start = next((i for i, line in enumerate(lines) if line.startswith("|")), None)
    assert start is not None, "no table"
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append([cell.strip() for cell in line.strip("|").split("|")])
    header, rule, *rows = table
    assert all(set(cell) <= set("-: ") for cell in rule), f"not a table rule: {rule}"
    for row in rows:
        assert len(row) == len(header), f"row {row} does not have the columns {header}"
    return [dict(zip(header, row)) for row in rows]


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


# -- docs/configuration.md against the config models -------------------------------------------------


def models_in(annotation: Any) -> list[type[pydantic.BaseModel]]:
    """The pydantic models an annotation names (``X``, ``X | None``, ``list[X]``...)."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return [annotation]
    found = []
    for arg in typing.get_args(annotation):
        found += models_in(arg)
    return found


def config_models() -> dict[str, type[pydantic.BaseModel]]:
    """OrchestratorConfig and every model nested in it, by class name."""
    seen: dict[str, type[pydantic.BaseModel]] = {}
    todo: list[type[pydantic.BaseModel]] = [OrchestratorConfig]
    while todo:
        model = todo.pop()
        if model.__name__ in seen:
            continue
        seen[model.__name__] = model
        for field in model.model_fields.values():
            todo += models_in(field.annotation)
    return seen


def documented_models() -> dict[str, list[dict[str, str]]]:
    """Model name -> its table's rows, from the ``... (model `Name`)`` headings of configuration.md."""
    out: dict[str, list[dict[str, str]]] = {}
    for heading, body in sections(CONFIGURATION.read_text()):
        match = _MODEL_HEADING.search(heading)
        if match:
            assert match.group(1) not in out, f"model {match.group(1)} documented twice"
            out[match.group(1)] = first_table(body)
    return out


def field_name(row: dict[str, str]) -> str:
    match = re.fullmatch(r"`(\w+)`", row["field"])
    assert match, f"the field cell must be one name in backticks: {row['field']!r}"
    return match.group(1)


def test_configuration_md_documents_every_config_model() -> None:
    assert set(documented_models()) == set(config_models())


@pytest.mark.parametrize("model_name", sorted(config_models()))
def test_configuration_md_lists_exactly_the_fields_of(model_name: str) -> None:
    model = config_models()[model_name]
    rows = documented_models().get(model_name)
    assert rows is not None, f"docs/configuration.md has no table for {model_name}"
    names = [field_name(row) for row in rows]
    assert len(names) == len(set(names)), f"{model_name}: a field is listed twice"
    missing = sorted(set(model.model_fields) - set(names))
    unknown = sorted(set(names) - set(model.model_fields))
    assert not missing, f"{model_name} fields missing from docs/configuration.md: {missing}"
    assert not unknown, f"docs/configuration.md lists {model_name} fields that do not exist: {unknown}"


def documented_default(cell: str) -> Any:
    """The value of a default cell: its first backticked text read as YAML (the config's own syntax)."""
    match = _BACKTICKED.search(cell)
    assert match, f"a default must be a YAML value in backticks, or 'required': {cell!r}"
    return yaml.safe_load(match.group(1))


@pytest.mark.parametrize("model_name", sorted(config_models()))
def test_configuration_md_defaults_are_the_models_defaults(model_name: str) -> None:
    model = config_models()[model_name]
    wrong = []
    for row in documented_models()[model_name]:
        name = field_name(row)
        field = model.model_fields.get(name)
        if field is None:
            continue  # the test above names it
        cell = row["default"]
        if field.is_required():
            if not cell.startswith("required"):
                wrong.append(f"{name}: the model requires it, the doc says {cell!r}")
            continue
        default = field.get_default(call_default_factory=True)
        value = documented_default(cell)
        if isinstance(default, pydantic.BaseModel):
            # A nested section's default is written as the mapping that builds it ({}: all defaults).
            ok = isinstance(value, dict) and type(default).model_validate(value) == default
        else:
            ok = value == default and (type(value) is bool) == (type(default) is bool)
        if not ok:
            wrong.append(f"{name}: the model's default is {default!r}, the doc says {cell!r}")
    assert not wrong, f"{model_name}: " + "; ".join(wrong)


def test_configuration_md_flag_table_matches_the_orchestrator_cli() -> None:
    parser = argparse.ArgumentParser()
    orchestrator_cli.add_arguments(parser)
    actions = {flag: action for action in parser._actions for flag in action.option_strings}
    actions.pop("-h", None)
    actions.pop("--help", None)

    (rows,) = [first_table(body) for heading, body in sections(CONFIGURATION.read_text())
               if heading == "Command-line flags"]  # fmt: skip
    documented: dict[str, str] = {}
    for row in rows:
        for flag in _BACKTICKED.findall(row["flag"]):
            documented[flag] = row["config key"]
    assert set(documented) == set(actions), (
        f"undocumented flags: {sorted(set(actions) - set(documented))}; "
        f"documented flags that do not exist: {sorted(set(documented) - set(actions))}"
    )
    overrides = orchestrator_cli._OVERRIDES  # flag dest -> dotted config key
    for flag, cell in documented.items():
        dest = actions[flag].dest
        key = _BACKTICKED.fullmatch(cell)
        if key is None:  # "(the file)", "(none)": a flag that sets no config key
            assert dest not in overrides, f"{flag} sets {overrides[dest]}, the doc says {cell!r}"
            continue
        assert overrides.get(dest) == key.group(1), f"{flag}: sets {overrides.get(dest)}, the doc says {cell}"
        # ... and the key is a field of the models.
        model: Any = OrchestratorConfig
        for part in key.group(1).split("."):
            assert part in model.model_fields, f"{flag}: {key.group(1)} is no config key"
            (model,) = models_in(model.model_fields[part].annotation) or [None]



def test_configuration_md_router_flags_name_the_router_types_the_config_takes() -> None:
    from server.orchestrator.config import ROUTER_TYPES

    (rows,) = [first_table(body) for heading, body in sections(CONFIGURATION.read_text())
               if heading == "Command-line flags"]  # fmt: skip
    (row,) = [r for r in rows if r["flag"] == "`--context-router`"]
    assert set(_BACKTICKED.findall(row["meaning"])) == set(ROUTER_TYPES)


def test_configuration_md_worker_http_limits_are_the_workers_and_say_which_differ() -> None:
    """The worker's HTTP limit flags: each default is the parser's, each names the orchestrator's key
    of the same bound, and "the same" is said exactly where the two defaults are equal."""
    from server.worker import cli as worker_cli

    parser = argparse.ArgumentParser()
    worker_cli.add_arguments(parser)
    (group,) = [g for g in parser._action_groups if g.title and g.title.startswith("HTTP limits")]
    flags = {a.option_strings[0]: a.default for a in group._group_actions}
    (rows,) = [first_table(body) for heading, body in sections(CONFIGURATION.read_text())
               if heading == "Worker HTTP limits"]  # fmt: skip
    documented = {row["flag"].strip("`"): row for row in rows}
    assert set(documented) == set(flags)
    config = OrchestratorConfig()
    for flag, row in documented.items():
        assert documented_default(row["default"]) == flags[flag], flag
        key = row["orchestrator's key"].strip("`")
        same = getattr(config, key) == flags[flag]
        assert (row["why the worker's differs"] == "the same") == same, f"{flag}: {key} is {getattr(config, key)}"



def test_configuration_md_says_the_drain_defaults_the_code_has() -> None:
    """The Faults section's figures: the worker's --drain-timeout, up's --drain-timeout-s and the
    margin after which up kills a child, each as its one home declares it."""
    from server import launcher
    from server.worker import cli as worker_cli

    up = argparse.ArgumentParser()
    launcher.add_arguments(up)
    text = " ".join(CONFIGURATION.read_text().split())
    assert f"`--drain-timeout` seconds (default `{worker_cli.DRAIN_TIMEOUT_S:g}`)" in text
    assert f"`fastcore-serve up --drain-timeout-s S` (default {up.get_default('drain_timeout_s'):g})" in text
    assert f"`S` + {launcher.STOP_MARGIN_S:g} s later" in text


# -- docs/examples ------------------------------------------------------------------------------------


EXAMPLE_FILES = sorted(EXAMPLES.glob("*.yaml"))


def load_example(path: Path, caplog: pytest.LogCaptureFixture) -> tuple[OrchestratorConfig, list[str]]:
    """The example through the orchestrator's loader and checks; the warnings it logged."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=CONFIG_LOGGER):
        config = build_config(load_config_file(path), environ={})
        config.check_runnable()
    return config, [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_the_examples_are_there() -> None:
    assert {p.name for p in EXAMPLE_FILES} >= {"minimal.yaml", "gates-on.yaml", "trtllm-disagg.yaml"}


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.name)
def test_example_config_validates(path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config, warnings = load_example(path, caplog)
    # a worker in each pool: listed, or found through the cluster
    assert config.disagg_cluster is not None or (config.context_servers.urls and config.generation_servers.urls)
    if path.name != "trtllm-disagg.yaml":
        assert not warnings, f"{path.name}: {warnings}"


def test_minimal_example_has_both_gates_off(caplog: pytest.LogCaptureFixture) -> None:
    config, _ = load_example(EXAMPLES / "minimal.yaml", caplog)
    assert not config.gen_tokids_ctxbytes and not config.gen_strip_message_history


def test_gates_on_example_has_both_gates_on(caplog: pytest.LogCaptureFixture) -> None:
    config, _ = load_example(EXAMPLES / "gates-on.yaml", caplog)
    assert config.gen_tokids_ctxbytes and config.gen_strip_message_history


def test_trtllm_example_loads_and_warns_about_the_keys_it_does_not_use(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config, warnings = load_example(EXAMPLES / "trtllm-disagg.yaml", caplog)
    unused = config.unused_keys()
    assert "backend" in unused and "context_servers.tensor_parallel_size" in unused
    assert config.context_servers.router.kind == "least_loaded"  # trtllm-serve's load_balancing
    assert config.context_servers.num_instances == len(config.context_servers.urls)
    assert any("not used" in w and "backend" in w for w in warnings), warnings


# -- links and paths ----------------------------------------------------------------------------------


MARKDOWN = sorted([ROOT / "README.md", *DOCS.rglob("*.md")])
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_REPO_PATH = re.compile(r"`((?:fastcore|server|bench|tests|docs)/[\w./-]*)`")


def anchors(path: Path) -> set[str]:
    return {github_slug(heading) for heading, _ in sections(path.read_text())}


@pytest.mark.parametrize("doc", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_into_the_repository(doc: Path) -> None:
    broken = []
    for target in _LINK.findall(without_code_blocks(doc.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (doc.parent / path_part).resolve() if path_part else doc
        if ROOT not in resolved.parents and resolved != ROOT:
            broken.append(f"{target} (outside the repository)")
        elif not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{doc.relative_to(ROOT)}: " + ", ".join(broken)


@pytest.mark.parametrize("doc", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_paths_named_in_the_docs_exist(doc: Path) -> None:
    missing = sorted({p for p in _REPO_PATH.findall(doc.read_text()) if not (ROOT / p).exists()})
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_architecture_md_names_every_server_and_fastcore_module() -> None:
    text = (DOCS / "architecture.md").read_text()
    modules = [
        p.relative_to(ROOT).as_posix()
        for top in ("fastcore", "server")
        for p in sorted((ROOT / top).rglob("*.py"))
        if p.name != "__init__.py" or p.parent.name == "fastcore"
    ]
    assert [m for m in modules if f"`{m}`" not in text] == []


# -- the repository stands alone ------------------------------------------------------------------


_TEXT_SUFFIXES = {
    ".py",
    ".pyx",
    ".pxd",
    ".pyi",
    ".c",
    ".h",
    ".md",
    ".txt",
    ".yaml",
    ".yml",
    ".toml",
    ".cfg",
    ".ini",
}
_TOP_LEVEL = ("README.md", "Makefile", "setup.py", "pyproject.toml", "MANIFEST.in", ".ci/run", ".ci/lint")
_SKIPPED_PARTS = {"__pycache__", "build", "data"}  # tests/data: third-party corpus bytes
# Cython's output, not ours
_GENERATED = {
    "fastcore/_codec.c",
    "fastcore/_scan.c",
    "fastcore/_relay.c",
    "fastcore/_hash.c",
    "server/http/_parse.c",
}


def project_text_files() -> list[Path]:
    files = [ROOT / name for name in _TOP_LEVEL if (ROOT / name).is_file()]
    for top in ("docs", "tests", "server", "fastcore", "bench"):
        for path in sorted((ROOT / top).rglob("*")):
            rel = path.relative_to(ROOT)
            if (
                path.is_file()
                and path.suffix in _TEXT_SUFFIXES
                and not _SKIPPED_PARTS & set(rel.parts[:-1])
                and rel.as_posix() not in _GENERATED
                and path != Path(__file__).resolve()
            ):
                files.append(path)
    return files


def mentions(pattern: re.Pattern[str]) -> list[str]:
    hits = []
    for path in project_text_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    return hits


_SHARED = re.compile(
    r"\.\./shared|/work/shared|shared/testdata|shared/PROTOCOL|parent\s*/\s*[\"']shared[\"']"
)


def test_nothing_refers_to_the_sibling_shared_directory() -> None:
    """A clone without the sibling shared directory must pass its tests and carry its docs: nothing may
    point there."""
    hits = mentions(_SHARED)
    assert not hits, "references to the sibling shared directory:\n" + "\n".join(hits)


def test_nothing_cites_the_old_shared_PROTOCOL_md() -> None:
    """The protocol is docs/protocol.md now; "PROTOCOL.md" named the copy in the sibling shared directory."""
    hits = mentions(re.compile(r"PROTOCOL\.md"))
    assert not hits, "cite docs/protocol.md instead of PROTOCOL.md:\n" + "\n".join(hits)


def test_the_json_corpus_is_in_the_repository_with_its_licence(json_test_suite: Path) -> None:
    assert json_test_suite == ROOT / "tests" / "data" / "JSONTestSuite"
    assert (json_test_suite / "LICENSE").read_text().startswith("MIT License")
    assert "nst/JSONTestSuite" in (json_test_suite / "README.md").read_text()
    counts = {prefix: len(list(json_test_suite.glob(f"{prefix}_*.json"))) for prefix in "yni"}
    assert counts == {"y": 95, "n": 188, "i": 35}


def test_the_readme_library_example_runs_as_written() -> None:
    """The first code a user who imports the codec reads: it must run and say what it says."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## The library\n", 1)[1].split("\n## ", 1)[0]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict[str, object] = {}
    exec(compile(code, "README.md", "exec"), scope)
    import fastcore

    assert fastcore.decode_tokens_list(scope["b64"]) == [128000, 9906, 0]  # type: ignore[arg-type]
    body = scope["body"]
    assert body[scope["start"] : scope["end"]] == b'"AQAAAAIAAAA="'  # type: ignore[index]
