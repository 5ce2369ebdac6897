"""The docs stay true to the repository: their links resolve, and every
environment variable the code reads is documented in the configuration page."""

import re
from pathlib import Path

from tests.conftest import ROOT

CONFIGURATION_PAGE = ROOT / "docs" / "operating" / "configuration.md"

# -- links ---------------------------------------------------------------------

FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
# [text](target) and ![alt](target); the text may hold inline code (backticks
# stripped already) and line breaks but no brackets. The target stops at a space
# (a title) or ")".
LINK = re.compile(r"!?\[[^\[\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.MULTILINE)


def doc_pages() -> list[Path]:
    """README.md and every page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def prose(text: str) -> str:
    """Markdown without its code blocks (their brackets are code, not links)."""
    return FENCE.sub("", text)


def links_in(text: str) -> list[str]:
    """Link targets of a page's prose; inline code is kept out of the search
    but a link whose text is inline code (`[`x`](y)`) still counts."""
    without_code = prose(text)
    without_code = INLINE_CODE.sub(lambda m: m.group(0).strip("`"), without_code)
    return LINK.findall(without_code)


def anchor_of(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, inline markup and punctuation
    dropped (hyphens and underscores kept), spaces turned into hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors_of(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, GitHub's -1, -2 for repeats."""
    seen: dict[str, int] = {}
    anchors = set()
    for _, heading in HEADING.findall(prose(path.read_text())):
        anchor = anchor_of(heading)
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        anchors.add(anchor if count == 0 else f"{anchor}-{count}")
    return anchors


def broken_links(page: Path, *, root: Path = ROOT) -> list[str]:
    """Each relative link of a page that leaves the repository (`root`), names
    no file there, or names an anchor its target page does not have."""
    problems = []
    for target in links_in(page.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        where = f"{page.relative_to(root)}: {target}"
        if not resolved.is_relative_to(root):
            problems.append(f"{where} (outside the repository)")
        elif not resolved.exists():
            problems.append(f"{where} (no such file)")
        elif anchor and resolved.suffix == ".md":
            if anchor not in anchors_of(resolved):
                problems.append(f"{where} (no such heading)")
    return problems


def test_every_relative_link_in_the_docs_resolves():
    """Each relative link in README.md and docs/ names a file of the repository
    and, for a Markdown page, a heading it has."""
    problems = [problem for page in doc_pages() for problem in broken_links(page)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_link_check_finds_broken_links(tmp_path):
    """Control: a page with a missing file, two missing headings (one link over
    two lines) and a link out of the repository is reported four times; its good
    links, and a link in a code block, are not."""
    (tmp_path / "README.md").write_text("# Readme\n")
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "control.md"
    page.write_text(
        "# Control\n\n## A heading\n\n"
        "[ok](../README.md) [ok](#a-heading) [ok](https://example.com/x)\n"
        "[a link over two\nlines](#not-a-heading-either)\n"
        "[gone](no-such-page.md) [gone](#no-heading) [out](../../outside.md)\n"
        "```\n[code, not a link](nowhere.md)\n```\n"
    )
    problems = broken_links(page, root=tmp_path)
    assert [problem.rsplit("(", 1)[1] for problem in problems] == [
        "no such heading)",
        "no such file)",
        "no such heading)",
        "outside the repository)",
    ]


def test_anchors_follow_github():
    """Heading anchors are GitHub's: punctuation and code marks dropped."""
    assert anchor_of("Batch API (`/v1/files`, `/v1/batches`)") == (
        "batch-api-v1files-v1batches"
    )
    assert anchor_of("bench/reliability.py: faults under load") == (
        "benchreliabilitypy-faults-under-load"
    )
    assert anchor_of("Limits: every caller, every path") == (
        "limits-every-caller-every-path"
    )


# -- environment variables -----------------------------------------------------

# Where the code reads its environment: the web side's settings (django-environ's
# `env.str("NAME", ...)` and its siblings), the engines' one module
# (`os.environ.get(NAME_ENV)` over module constants), the set-up and run scripts
# (`${NAME:-default}`), and the benchmarks' and tests' own switches.
PYTHON_SOURCES = ("platform", "engines", "routing", "bench", "tests", "manage.py")
SHELL_SOURCES = ("scripts", "Makefile", ".ci/run", "Procfile")

ENV_HELPER_CALL = re.compile(
    r"\benv\.(?:str|int|float|bool|list|tuple|dict|json|url|db_url|db|cache_url"
    r"|cache|email_url|path|bytes|search_url)\(\s*[\"']([A-Z][A-Z0-9_]*)[\"']"
)
# os.environ.setdefault is left out: it sets a library's switch for this
# process and its children (TQDM_DISABLE), it does not take configuration.
ENVIRON_READ = re.compile(
    r"\bos\.(?:environ\.get|environ\.pop|getenv)\(\s*"
    r"(?:[\"']([A-Z][A-Z0-9_]*)[\"']|([A-Za-z_][A-Za-z0-9_]*)\s*[,)])"
)
# os.environ["NAME"] read, not assigned (an assignment sets it for a child).
ENVIRON_INDEX = re.compile(
    r"\bos\.environ\[\s*(?:[\"']([A-Z][A-Z0-9_]*)[\"']|([A-Za-z_][A-Za-z0-9_]*))"
    r"\s*\](?!\s*=[^=])"
)
STRING_CONSTANT = re.compile(
    r"^([A-Z][A-Z0-9_]*)\s*=\s*[\"']([A-Z][A-Z0-9_]*)[\"']", re.MULTILINE
)
SHELL_DEFAULTED = re.compile(r"\$\{([A-Z][A-Z0-9_]*):?[-=?+]")

# Variables that belong to the operating system, Python or Django, not to
# Roundhouse: read to pass them on or to set a library up, never configuration.
NOT_OURS = frozenset(
    {
        "DJANGO_SETTINGS_MODULE",
        "DJANGO_ALLOW_ASYNC_UNSAFE",
        "PYTHONPATH",
        "HOME",
        "PATH",
    }
)
# A benchmark's hand-over of a secret to the child processes it starts itself:
# not configuration anyone sets.
INTERNAL_HANDOVERS = frozenset({"BENCH_TOKEN", "BENCH_LINK_SECRET"})


def source_files(names: tuple[str, ...]) -> list[Path]:
    """The files under these repository paths (a folder: every file in it)."""
    files = []
    for name in names:
        path = ROOT / name
        if path.is_dir():
            files.extend(p for p in sorted(path.rglob("*")) if p.is_file())
        elif path.exists():
            files.append(path)
    # This module's own examples of reading a variable are not reads.
    this_module = Path(__file__).resolve()
    return [
        f for f in files if "__pycache__" not in f.parts and f.resolve() != this_module
    ]


def variables_read_by_python(text: str) -> set[str]:
    """Environment variables a Python module reads: literal names, and names
    held in the module's own string constants (`TOKEN_ENV = "ROUNDHOUSE_..."`)."""
    constants = dict(STRING_CONSTANT.findall(text))
    found = set(ENV_HELPER_CALL.findall(text))
    for literal, identifier in ENVIRON_READ.findall(text) + ENVIRON_INDEX.findall(text):
        if literal:
            found.add(literal)
        elif identifier in constants:
            found.add(constants[identifier])
    return found


def variables_read() -> dict[str, set[str]]:
    """Every environment variable the code reads, with the files that read it."""
    readers: dict[str, set[str]] = {}
    for path in source_files(PYTHON_SOURCES):
        if path.suffix != ".py":
            continue
        for name in variables_read_by_python(path.read_text()):
            readers.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    for path in source_files(SHELL_SOURCES):
        for name in SHELL_DEFAULTED.findall(path.read_text()):
            readers.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    for name in NOT_OURS | INTERNAL_HANDOVERS:
        readers.pop(name, None)
    return readers


def documented_variables(text: str) -> set[str]:
    """Variables named in the first cell of a table row of the page."""
    names = set()
    for row in re.findall(r"^\|([^|\n]*)\|", text, re.MULTILINE):
        names.update(re.findall(r"`([A-Z][A-Z0-9_]*)`", row))
    return names


def test_the_scan_finds_variables_read_every_way():
    """Control: each way the code reads a variable is found, assignments and
    other modules' constants are not."""
    text = (
        'A_ENV = "ROUNDHOUSE_VIA_CONSTANT"\n'
        'X = env.int(\n    "ROUNDHOUSE_VIA_HELPER", default=1)\n'
        'os.environ.get("ROUNDHOUSE_VIA_GET")\n'
        "os.environ.pop(A_ENV, '')\n"
        'os.environ["ROUNDHOUSE_VIA_INDEX"]\n'
        'os.environ["ROUNDHOUSE_ONLY_SET"] = "1"\n'
        "os.environ.get(UNKNOWN_CONSTANT)\n"
    )
    assert variables_read_by_python(text) == {
        "ROUNDHOUSE_VIA_CONSTANT",
        "ROUNDHOUSE_VIA_HELPER",
        "ROUNDHOUSE_VIA_GET",
        "ROUNDHOUSE_VIA_INDEX",
    }
    assert SHELL_DEFAULTED.findall("x=${ROUNDHOUSE_VENV:-.venv} ${HOME}") == [
        "ROUNDHOUSE_VENV"
    ]


def test_the_scan_sees_the_settings_and_the_engines_variables():
    """The scan reaches both reading modules (a broken regex would find nothing
    and document nothing)."""
    read = variables_read()
    assert {"DATABASE_URL", "ROUNDHOUSE_CLUSTER_CA"} <= read.keys()  # settings.py
    assert {"ROUNDHOUSE_ENGINE_TOKEN", "ROUNDHOUSE_THERMAL_FILE"} <= read.keys()
    assert "ROUNDHOUSE_LLAMA_CMAKE_ARGS" in read  # scripts/


def test_every_environment_variable_read_is_documented():
    """Each variable the code reads has a row in docs/operating/configuration.md."""
    documented = documented_variables(CONFIGURATION_PAGE.read_text())
    missing = {
        name: sorted(files)
        for name, files in variables_read().items()
        if name not in documented
    }
    assert not missing, (
        "read by the code but not in docs/operating/configuration.md: "
        + "; ".join(f"{name} ({', '.join(files)})" for name, files in missing.items())
    )
