"""The documentation holds together: every relative link and image in the README and docs/
resolves to a file of the repository, every `#anchor` to a heading of its page (GitHub's slug
rules); nothing in the repository points at a file outside it; every `docs/algorithms.md N` the
code cites is a section there; the README stays short, with every section in its contents;
every page under docs/ outside docs/benchmarks/ stays within 400 lines.

Pure and fast: it reads files, nothing else.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
ALGORITHMS = ROOT / "docs" / "algorithms.md"
README_MAX_LINES = 300
# A page under docs/ describes the system as it is now; run journals go to docs/benchmarks/.
DOC_PAGE_MAX_LINES = 400

# Not the project's own files: virtual environments, model weights, run state, caches.
SKIP_DIRS = {".git", ".venv", "run", "models", "__pycache__", ".pytest_cache", ".ruff_cache", ".mypy_cache", ".whl"}
SKIP_PATHS = {ROOT / "bench" / ".envs"}
BINARY_SUFFIXES = {".png", ".jpg", ".jpeg", ".gif", ".gguf", ".safetensors", ".pt", ".bin", ".so", ".whl", ".gz"}

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# [text](target) and ![alt](target); the target may be <...> and may carry a "title".
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
REF_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(\S+)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# Pointers outside the repository. Spelled in pieces so this file does not match itself.
OUTSIDE = re.compile(
    "|".join(
        [
            r"\.\./" + "shared",
            r"\b" + "ALGO" + r"RITHMS\.md",
            r"\b" + "DES" + r"IGN\.md",
            r"\b" + "STY" + r"LE\.md",
            r"(?<![\w.~-])/" + "work" + r"(?=/|\b)",
        ]
    )
)
CITATION = re.compile(r"docs/algorithms\.md\s*(?:§\s*)?(\d+)\b")
SECTION = re.compile(r"^##\s+(\d+)\.\s")


def markdown_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def repository_files() -> Iterator[Path]:
    """Every file of the project itself (not its environments, models or run state)."""

    def walk(folder: Path) -> Iterator[Path]:
        for entry in sorted(folder.iterdir()):
            # A worktree's .git is a file naming the main checkout: git's, not the project's.
            if entry.is_symlink() or entry in SKIP_PATHS or entry.name in SKIP_DIRS:
                continue
            if entry.is_dir():
                if not entry.name.endswith(".egg-info"):
                    yield from walk(entry)
            elif entry.is_file() and entry.suffix not in BINARY_SUFFIXES:
                yield entry

    yield from walk(ROOT)


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its rendered text, lowercased, with every character
    but letters, digits, spaces, hyphens and underscores dropped, and spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "")
    return "".join(c for c in text.lower() if c.isalnum() or c in " -_").replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, with GitHub's -1, -2 suffixes for repeats."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def links(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, target) of every link and image in prose (code spans and blocks skipped)."""
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        line = INLINE_CODE.sub("", line)
        for match in LINK.finditer(line):
            yield number, match.group(1).strip("<>")
        ref = REF_DEFINITION.match(line)
        if ref:
            yield number, ref.group(1)


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with the relative links of one Markdown file, one line per problem."""
    problems = []
    for number, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
            continue
        where = f"{path.relative_to(root)}:{number}: {target!r}"
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.is_relative_to(root.resolve()):
            problems.append(f"{where} points outside the repository")
            continue
        if not dest.exists():
            problems.append(f"{where}: no such file {dest.relative_to(root.resolve())}")
            continue
        if anchor:
            page = dest / "README.md" if dest.is_dir() else dest
            if page.suffix != ".md" or not page.exists():
                problems.append(f"{where}: an anchor into a file with no headings")
            elif anchor not in anchors(page):
                problems.append(f"{where}: no heading with anchor #{anchor} in {page.relative_to(root.resolve())}")
    return problems


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(path: Path) -> None:
    problems = broken_links(path)
    assert not problems, "\n".join(problems)


def test_no_file_points_outside_the_repository() -> None:
    found = []
    for path in repository_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            match = OUTSIDE.search(line)
            if match:
                found.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r} in {line.strip()[:120]!r}")
    assert not found, "files that point outside the repository:\n" + "\n".join(found)


def test_every_algorithms_citation_names_a_section() -> None:
    sections = {
        int(m.group(1)) for _, line in prose_lines(ALGORITHMS.read_text(encoding="utf-8")) if (m := SECTION.match(line))
    }
    assert sections == set(range(1, max(sections) + 1)), f"sections are numbered 1..N without gaps: {sorted(sections)}"
    cited: dict[int, list[str]] = {}
    for path in repository_files():
        if path.suffix not in (".py", ".md", ".toml", ".proto"):
            continue
        text = path.read_text(encoding="utf-8")
        for match in CITATION.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            cited.setdefault(int(match.group(1)), []).append(f"{path.relative_to(ROOT)}:{line}")
    assert len(cited) >= 5, f"expected the code to cite most sections, found {sorted(cited)}"
    unknown = {n: where for n, where in cited.items() if n not in sections}
    assert not unknown, f"citations of sections docs/algorithms.md does not have ({sorted(sections)}): {unknown}"


def test_readme_is_short_and_its_contents_reach_every_section() -> None:
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines, more than {README_MAX_LINES}"
    sections = [m.group(2) for _, line in prose_lines(text) if (m := HEADING.match(line)) and m.group(1) == "##"]
    assert "Contents" in sections, "README.md has no '## Contents'"
    start = lines.index("## Contents")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    toc = {m.group(1) for m in re.finditer(r"\]\(#([^)]+)\)", "\n".join(lines[start:end]))}
    missing = [s for s in sections if s != "Contents" and github_slug(s) not in toc]
    assert not missing, f"sections missing from the README's contents: {missing}"


def design_pages() -> list[Path]:
    """Every Markdown page under docs/ except the benchmark journals under docs/benchmarks/."""
    benchmarks = ROOT / "docs" / "benchmarks"
    return [p for p in sorted((ROOT / "docs").rglob("*.md")) if not p.is_relative_to(benchmarks)]


def test_every_docs_page_outside_benchmarks_is_at_most_400_lines() -> None:
    pages = design_pages()
    assert pages, "no Markdown pages found under docs/"
    too_long = [
        f"{path.relative_to(ROOT)}: {count} lines"
        for path in pages
        if (count := len(path.read_text(encoding="utf-8").splitlines())) > DOC_PAGE_MAX_LINES
    ]
    assert not too_long, (
        f"docs pages longer than {DOC_PAGE_MAX_LINES} lines (move run journals to docs/benchmarks/):\n"
        + "\n".join(too_long)
    )


# ---- the checker itself --------------------------------------------------------------------------


def test_slugs_follow_github() -> None:
    assert github_slug("The two commands") == "the-two-commands"
    assert github_slug("Operating it: CLI, dashboard, metrics") == "operating-it-cli-dashboard-metrics"
    assert github_slug("`python -m bench.gpu` — the engine on a CUDA device") == (
        "python--m-benchgpu--the-engine-on-a-cuda-device"
    )
    assert github_slug("6. LoongServe batching (`services/global_manager/core/esp.py`)") == (
        "6-loongserve-batching-servicesglobal_managercoreesppy"
    )
    assert github_slug("The [dashboard](x.md)") == "the-dashboard"


def test_the_checker_finds_a_missing_file_a_missing_anchor_and_a_way_out(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# B\n\n## Real heading\n\n## Real heading\n", encoding="utf-8")
    page = tmp_path / "docs" / "a.md"
    page.write_text(
        "# A\n\n"
        "[ok](b.md#real-heading) [repeat](b.md#real-heading-1) [self](#a) [web](https://example.com/x)\n"
        "[gone](missing.md) [bad anchor](b.md#no-such-heading) [out](../../elsewhere.md)\n"
        "`[in code](missing-too.md)`\n\n```\n[in a block](missing-three.md)\n```\n",
        encoding="utf-8",
    )
    problems = broken_links(page, root=tmp_path)
    assert len(problems) == 3, problems
    assert "'missing.md': no such file docs/missing.md" in problems[0]
    assert "no heading with anchor #no-such-heading in docs/b.md" in problems[1]
    assert "points outside the repository" in problems[2]


def test_the_outside_pattern_catches_each_kind_and_spares_lookalikes() -> None:
    hits = [
        "see " + "../" + "shared/traces",
        "as " + "ALGO" + "RITHMS.md says",
        "(" + "DES" + "IGN.md: 7e-5)",
        "per " + "STY" + "LE.md",
        '"trace": "/' + 'work/main/traces/x.csv"',
    ]
    for text in hits:
        assert OUTSIDE.search(text), text
    for text in ["services/worker/engine.py", "docs/algorithms.md 3", "/workspace", "network/work"]:
        assert not OUTSIDE.search(text), text
