"""The README stays a short front page: every reference page is one link from it, every link in
the documents resolves (file and heading), and its example command lines parse with the CLI's
own flags."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
DOCUMENTS = [README, ROOT / "CONTRIBUTING.md", ROOT / "SECURITY.md", *DOCS]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(m) for m in re.findall(r"^#+ (.+)$", text, re.M)}


def test_the_readme_is_a_front_page_that_links_every_reference_page():
    text = README.read_text()
    assert len(text.splitlines()) < 200
    assert DOCS, "docs/ holds the reference pages"
    linked = {target.split("#")[0] for target in LINK.findall(text)}
    assert {f"docs/{page.name}" for page in DOCS} <= linked


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves_to_a_file_and_heading(document):
    broken = []
    for target in LINK.findall(document.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (document.parent / path).resolve() if path else document
        if not file.exists() or (anchor and file.suffix == ".md" and anchor not in anchors(file)):
            broken.append(target)
    assert not broken, f"{document.name}: {broken}"


def readme_command_lines() -> list[list[str]]:
    text = README.read_text()
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith("aphrodite "):
                lines.append(shlex.split(line)[1:])
    return lines


def test_every_readme_command_line_parses_with_the_cli_flags():
    import typer

    from aphrodite_cli.main import app

    root = typer.main.get_command(app)
    lines = readme_command_lines()
    assert len(lines) >= 15
    for args in lines:
        command, rest = root, list(args)
        while hasattr(command, "get_command"):  # a group (typer ships its own click)
            if getattr(command, "invoke_without_command", False) and (
                    not rest or rest[0].startswith("-")):
                break  # a group that is a command itself (bench sweep, beside sweep serve)
            command, rest = command.get_command(None, rest[0]), rest[1:]
            assert command is not None, args
        # parsing builds the context (unknown flags, bad types, missing arguments raise)
        # without running the command
        command.make_context(" ".join(args), rest)
