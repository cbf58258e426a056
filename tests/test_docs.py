"""The documentation holds together: its links lead somewhere, its test command is the one CI runs,
every page can be reached from the README, and every test it cites exists. Reads files only."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.MULTILINE)
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)


def prose(text: str) -> str:
    """The text without fenced code blocks (a bash comment there is no heading, a `[x](y)` no link)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, lowercased, punctuation but - and _ dropped,
    each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor on a page; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(prose(page.read_text())):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> list[str]:
    text = INLINE_CODE.sub("", prose(page.read_text()))
    return LINK.findall(text) + REFERENCE.findall(text)


def is_external(target: str) -> bool:
    return re.match(r"^[a-z][a-z0-9+.-]*:", target) is not None


def resolve(page: Path, target: str) -> tuple[Path, str]:
    path, _, anchor = target.partition("#")
    return (page if not path else (page.parent / path).resolve()), anchor


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for target in links(page):
        if is_external(target):
            continue
        path, anchor = resolve(page, target)
        if not path.exists():
            broken.append(f"{target}: no file {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading #{anchor} in {path.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_readme_test_command_is_the_one_ci_runs():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if "-m pytest" in line]
    blocks = re.findall(r"^```bash\n(.*?)^```", (ROOT / "README.md").read_text(), re.MULTILINE | re.DOTALL)
    readme = [line for block in blocks for line in block.splitlines() if "-m pytest" in line]
    assert len(ci) == 1 and len(readme) == 1, (ci, readme)
    assert readme[0] == ci[0]


def test_every_docs_page_is_linked_from_the_readme():
    readme = ROOT / "README.md"
    linked = {resolve(readme, target)[0] for target in links(readme) if not is_external(target)}
    unlinked = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def cited_text(page: Path) -> str:
    """What a page says of this project: docs/seeds.md's second column quotes the seeds' own names
    (their test files among them), which are not this project's."""
    text = page.read_text()
    if page.name != "seeds.md":
        return text
    return "\n".join("|".join(line.split("|")[:2] + line.split("|")[3:]) if line.startswith("|") else line
                     for line in text.splitlines())


def test_every_test_the_docs_cite_exists():
    """A promise that names its test names one that is there (a file in tests/, or a test function)."""
    test_sources = {p.name: p.read_text() for p in (ROOT / "tests").glob("test_*.py")}
    functions = set(re.findall(r"^def (test_\w+)", "\n".join(test_sources.values()), re.MULTILINE))
    missing = []
    for page in PAGES:
        for name in sorted(set(re.findall(r"\btest_\w+(?:\.py)?", cited_text(page)))):
            known = name in test_sources if name.endswith(".py") else name in functions
            if not known:
                missing.append(f"{page.relative_to(ROOT)}: {name}")
    assert not missing, "cited tests that do not exist: " + ", ".join(missing)
