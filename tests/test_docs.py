"""What README.md and docs/ point at exists: relative links (and their #anchors, by GitHub's
heading slugs), `make` targets, `python -m` modules of this repository, `fairserve`
subcommands, and repository paths quoted in backticks.

Fast and marker-free: it reads files, the Makefile and the CLI's argparse tree (cluster/cli.py
imports no model code); it imports none of the modules it checks, which are found by path.
Each test fails with the list of everything missing, where it was quoted.
"""

from __future__ import annotations

import argparse
import re
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest

REPO = Path(__file__).resolve().parents[1]
REPO_PATH_PREFIXES = ("router/", "replicas/", "cluster/", "deploy/", "helm/", "tests/", "docs/")
LOCAL_PACKAGES = ("router", "replicas", "cluster", "helm", "tests", "deploy")
SHELL_FENCES = ("bash", "sh", "shell", "console", "")

FENCE = re.compile(r"^(```|~~~)\s*([\w+-]*)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)?)`(?!`)")
MAKE = re.compile(r"(?<![\w-])make\s+([a-z][\w-]*)")
PYTHON_M = re.compile(r"(?<![\w-])python3?\s+-m\s+([A-Za-z_][\w.]*)")
FAIRSERVE = re.compile(r"(?<![\w./-])fairserve\s+([a-z][\w-]*)(?:\s+([a-z][\w-]*))?")


@dataclass(frozen=True)
class Doc:
    path: Path
    prose: list[tuple[int, str]]  # (line number, text) outside fenced code
    fenced: list[tuple[int, str, str]]  # (line number, fence language, text) inside it

    @property
    def name(self) -> str:
        return str(self.path.relative_to(REPO))


def _docs() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _read(path: Path) -> Doc:
    prose: list[tuple[int, str]] = []
    fenced: list[tuple[int, str, str]] = []
    fence: str | None = None
    language = ""
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        opened = FENCE.match(line.lstrip())
        if fence is None and opened:
            fence, language = opened.group(1), opened.group(2).lower()
            continue
        if fence is not None and line.strip().startswith(fence):
            fence = None
            continue
        if fence is None:
            prose.append((number, line))
        else:
            fenced.append((number, language, line))
    return Doc(path, prose, fenced)


DOCS = [_read(p) for p in _docs() if p.exists()]


def _prose_text(doc: Doc) -> str:
    return "\n".join(line for _, line in doc.prose)


def _line_of(doc: Doc, offset: int) -> int:
    """The file's line number of a character offset into ``_prose_text(doc)``."""
    index = _prose_text(doc).count("\n", 0, offset)
    return doc.prose[index][0]


def _code_spans(doc: Doc) -> Iterator[tuple[int, str]]:
    text = _prose_text(doc)
    for match in CODE_SPAN.finditer(text):
        yield _line_of(doc, match.start()), " ".join(match.group(1).split())


def _command_texts(doc: Doc) -> Iterator[tuple[int, str]]:
    """Where commands are quoted: inline code, and shell blocks (their comments dropped);
    a block of output or a diagram is fenced as `text`, and its words are not commands."""
    yield from _code_spans(doc)
    for number, language, line in doc.fenced:
        if language in SHELL_FENCES:
            yield number, re.sub(r"(^|\s)#.*$", "", line)


# --- anchors: GitHub's slugs -------------------------------------------------------------

def _heading_text(raw: str) -> str:
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", raw)  # links keep their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    return text.replace("`", "").replace("*", "").strip()


def github_slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (letters, digits, spaces,
    hyphens and underscores kept), each space a hyphen."""
    text = _heading_text(heading).lower()
    kept = "".join(ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(doc: Doc) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in doc.prose:
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = github_slug(heading.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    for _, line in doc.prose:  # explicit <a id="..."> / <a name="...">
        found.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", line))
    return found


ANCHORS = {doc.path: anchors(doc) for doc in DOCS}


def _anchors_of(path: Path) -> set[str]:
    if path not in ANCHORS:
        ANCHORS[path] = anchors(_read(path))
    return ANCHORS[path]


# --- what exists -------------------------------------------------------------------------

def make_targets() -> set[str]:
    targets: set[str] = set()
    for line in (REPO / "Makefile").read_text(encoding="utf-8").splitlines():
        rule = re.match(r"^([A-Za-z0-9_.-]+(?:\s+[A-Za-z0-9_.-]+)*)\s*:(?!=)", line)
        if rule and not line.startswith("\t"):
            targets.update(rule.group(1).split())
    return targets


def module_exists(dotted: str) -> bool:
    base = REPO.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file() \
        or (base / "__main__.py").is_file()


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__("parser built")
        self.parser = parser


def cli_commands() -> dict[str, set[str]]:
    """``fairserve``'s subcommands, each with its own subcommands (empty: none), read from the
    parser ``cluster.cli.main`` builds (stopped before it parses anything)."""
    from cluster import cli

    def stop(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise _Parsed(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", stop):
        try:
            cli.main([])
        except _Parsed as built:
            parser = built.parser
        else:  # pragma: no cover - main() always parses
            raise AssertionError("cluster.cli.main() built no parser")

    def choices(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}

    return {name: set(choices(sub)) for name, sub in choices(parser).items()}


# --- the checks --------------------------------------------------------------------------

def _report(what: str, missing: list[str]) -> str:
    return f"{len(missing)} {what}:\n  " + "\n  ".join(missing)


def test_relative_links_resolve() -> None:
    """Links and images: the file exists; a #anchor names a heading of a Markdown file."""
    missing: list[str] = []
    for doc in DOCS:
        text = _prose_text(doc)
        for match in LINK.finditer(text):
            target = match.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            where = f"{doc.name}:{_line_of(doc, match.start())}: ({target})"
            file_part, _, anchor = target.partition("#")
            path = (doc.path.parent / file_part).resolve() if file_part else doc.path
            if not path.exists():
                missing.append(f"{where}: no file {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
                continue
            if not path.is_relative_to(REPO):
                missing.append(f"{where}: outside the repository")
                continue
            if anchor and path.suffix == ".md" and anchor not in _anchors_of(path):
                missing.append(f"{where}: no heading #{anchor} in {path.relative_to(REPO)}")
    assert not missing, _report("broken links", missing)


def test_make_targets_exist() -> None:
    targets = make_targets()
    missing = [f"{doc.name}:{number}: make {target}"
               for doc in DOCS for number, text in _command_texts(doc)
               for target in MAKE.findall(text) if target not in targets]
    assert not missing, _report("make targets not in the Makefile", missing)


def test_python_modules_exist() -> None:
    missing = [f"{doc.name}:{number}: python -m {module}"
               for doc in DOCS for number, text in _command_texts(doc)
               for module in PYTHON_M.findall(text)
               if module.split(".")[0] in LOCAL_PACKAGES and not module_exists(module)]
    assert not missing, _report("`python -m` modules not in the repository", missing)


def test_fairserve_subcommands_exist() -> None:
    commands = cli_commands()
    missing: list[str] = []
    for doc in DOCS:
        for number, text in _command_texts(doc):
            for command, sub in FAIRSERVE.findall(text):
                where = f"{doc.name}:{number}: fairserve {command} {sub}".rstrip()
                known = commands.get(command)
                if known is None or (known and sub and sub not in known):
                    missing.append(where)
    assert not missing, _report("`fairserve` subcommands not in cluster/cli.py's parser",
                                missing)


def test_quoted_repository_paths_exist() -> None:
    missing: list[str] = []
    for doc in DOCS:
        for number, span in _code_spans(doc):
            if not span.startswith(REPO_PATH_PREFIXES):
                continue
            path = span.split()[0].rstrip(".,;:")
            if "<" in path or "{" in path:  # a template: `fs:{t}:...`, `.../<key>`
                continue
            exists = any(REPO.glob(path)) if "*" in path else (REPO / path).exists()
            if not exists:
                missing.append(f"{doc.name}:{number}: `{path}`")
    assert not missing, _report("repository paths that do not exist", missing)


@pytest.mark.parametrize(("heading", "slug"), [
    ("What is checked, and what is not", "what-is-checked-and-what-is-not"),
    ("Several choices (`n`)", "several-choices-n"),
    ("Usage records' cost", "usage-records-cost"),
    ("Against llama.cpp on the same GGUF", "against-llamacpp-on-the-same-gguf"),
    ("`replicas.autoscaling`", "replicasautoscaling"),
    ("`models[]`", "models"),
    ("[Engine](engine.md) knobs", "engine-knobs"),
])
def test_github_slug(heading: str, slug: str) -> None:
    assert github_slug(heading) == slug
