"""The documentation's links and file paths point at files that exist in the repository.

Checked in README.md, docs/*.md, benchmarks/README.md and examples/README.md:

- every relative Markdown link ``[text](target)`` (and image) resolves to an existing file
  or folder inside the repository;
- every ``#anchor`` into a Markdown file (or the same file) matches one of its headings,
  under GitHub's slug rules;
- nothing names ``../shared`` (a fresh clone has no such folder);
- every repository path written in backticks (``lightning_dapple/...``, ``tests/...``,
  ``scripts/...``, ...; or ``execute/slicing.py``-style paths inside the package) exists.

Pure file reading: no imports of the package.
"""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "lightning_dapple"

ROOT_PREFIXES = ("lightning_dapple/", "tests/", "scripts/", "benchmarks/", "examples/", "docs/", "conf/", "recipes/", ".ci/")
PACKAGE_PREFIXES = tuple(
    f"{name}/" for name in ("profile", "plan", "schedule", "simulate", "execute", "strategy", "app", "cli", "models", "data", "conf")
)

FENCE = re.compile(r"^ {0,3}(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)", re.DOTALL)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def doc_files() -> list[Path]:
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    files += [p for p in (REPO / "benchmarks" / "README.md", REPO / "examples" / "README.md") if p.is_file()]
    return files


def prose(text: str) -> str:
    """The text with fenced code blocks blanked (line count kept)."""
    out, fenced = [], None
    for line in text.split("\n"):
        match = FENCE.match(line)
        if fenced is None and match:
            fenced = match.group(1)
            out.append("")
        elif fenced is not None:
            if line.strip().startswith(fenced):
                fenced = None
            out.append("")
        else:
            out.append(line)
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation other than - and _ dropped, spaces to -."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in "-_ ")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    for line in prose(path.read_text(encoding="utf-8")).split("\n"):
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            n = counts.get(base, 0)
            counts[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def inside_repo(path: Path) -> bool:
    try:
        path.resolve().relative_to(REPO)
    except ValueError:
        return False
    return True


def check_links(path: Path, body: str) -> list[str]:
    problems = []
    rel = path.relative_to(REPO)
    for match in LINK.finditer(CODE_SPAN.sub(lambda m: " " * len(m.group(0)), body)):
        target, where = match.group(1), f"{rel}:{line_of(body, match.start())}"
        if SCHEME.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part) if file_part else path
        if not inside_repo(dest):
            problems.append(f"{where}: link {target!r} leaves the repository")
            continue
        if not dest.exists():
            problems.append(f"{where}: link {target!r}: {dest.relative_to(REPO)} does not exist")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: link {target!r}: no heading with anchor #{anchor} in {dest.relative_to(REPO)}")
    return problems


def repo_path(span: str) -> str | None:
    """The path a code span names, or None when it is not a checkable repository path."""
    text = span.strip()
    if any(ch in text for ch in "*{< \t\n"):
        return None
    text = text.split("::", 1)[0]
    text = re.sub(r"(\.(?:py|sh|md|json|yaml|txt|png)):[A-Za-z_][\w.]*$", r"\1", text)  # file.py:function
    text = text.rstrip(".,;:)")
    if text.startswith(ROOT_PREFIXES) or text.startswith(PACKAGE_PREFIXES):
        return text
    return None


def resolve(text: str) -> Path | None:
    candidates = []
    if text.startswith(ROOT_PREFIXES):
        candidates.append(REPO / text)
    if text.startswith(PACKAGE_PREFIXES):
        candidates.append(PACKAGE / text)
    for candidate in candidates:
        if candidate.exists():
            return candidate
    return None


def check_paths(path: Path, body: str) -> list[str]:
    problems = []
    rel = path.relative_to(REPO)
    for match in CODE_SPAN.finditer(body):
        text = repo_path(match.group(2))
        if text is not None and resolve(text) is None:
            problems.append(f"{rel}:{line_of(body, match.start())}: path `{text}` does not exist")
    return problems


def check_shared(path: Path, text: str) -> list[str]:
    rel = path.relative_to(REPO)
    return [f"{rel}:{n}: names ../shared, which a clone lacks" for n, line in enumerate(text.split("\n"), 1) if "../shared" in line]


def test_slug_follows_github() -> None:
    assert slug("Quick start (fresh machine, two commands)") == "quick-start-fresh-machine-two-commands"
    assert slug("bench_schedules.py") == "bench_schedulespy"
    assert slug("Simulated against measured (`--measured`)") == "simulated-against-measured---measured"
    assert slug("Table 4 (DAPPLE sec. 6.2) from the model") == "table-4-dapple-sec-62-from-the-model"


def test_repo_path_rules() -> None:
    assert repo_path("tests/test_user_steps.py::test_x") == "tests/test_user_steps.py"
    assert repo_path("execute/slicing.py") == "execute/slicing.py"
    assert repo_path("benchmarks/bench_gpu.py:gpu_report") == "benchmarks/bench_gpu.py"
    assert repo_path("tests/test_cuda*.py") is None
    assert repo_path("python benchmarks/bench_ooo.py") is None
    assert repo_path("self.layers") is None
    assert resolve("strategy/loss_check.py") == PACKAGE / "strategy" / "loss_check.py"
    assert resolve("tests/no_such_file.py") is None


def test_docs_links_and_paths_exist() -> None:
    files = doc_files()
    assert (REPO / "README.md") in files and len(files) > 2
    problems = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        body = prose(text)
        problems += check_shared(path, text)
        problems += check_links(path, body)
        problems += check_paths(path, body)
    assert not problems, f"{len(problems)} broken link(s) or path(s):\n" + "\n".join(problems)
