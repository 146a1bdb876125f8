"""What a reader of README.md and docs/ can follow: no paths of the machine the docs were written
on, no references to an issue tracker the reader cannot see, and no link to an anchor that is not
there.

The rules:

- ``/work/``, ``/root/`` and ``/home/`` never appear (they name one machine's directories);
- ``/tmp/`` appears only inside code (a fenced block or backticks), where a scratch directory in
  an example command is legitimate;
- no ``issue #N`` or ``PR #N``: the docs stand on their own;
- every link to ``FILE.md#anchor`` or ``#anchor`` names a heading of that file (GitHub's slugs) or
  an explicit ``<a id=...>``, and every linked ``FILE.md`` exists.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NAMES = [p.relative_to(ROOT).as_posix() for p in PAGES]


def _without_code(text: str) -> str:
    """``text`` less its fenced and indented code blocks and inline code."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = re.sub(r"^    .*$", "", text, flags=re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    seen: dict[str, int] = {}
    out = set(re.findall(r'<a (?:id|name)="([^"]+)"', text))
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        s = slug(heading)
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def test_slug_is_githubs():
    heading = "Learning rate × staleness: the map, 100 steps"
    assert slug(heading) == "learning-rate--staleness-the-map-100-steps"
    assert slug("`prompt_reward` — bring your own dataset") == "prompt_reward--bring-your-own-dataset"


@pytest.mark.parametrize("page", PAGES, ids=NAMES)
def test_no_machine_paths(page):
    text = page.read_text(encoding="utf-8")
    found = re.findall(r"(?<![\w.~-])/(?:work|root|home)/[^\s)`'\"]*", text)
    assert not found, f"{page.name} names directories of one machine: {found[:5]}"
    loose = re.findall(r"(?<![\w.~-])/tmp/[^\s)`'\"]*", _without_code(text))
    assert not loose, f"{page.name} names /tmp paths outside code: {loose[:5]}"


@pytest.mark.parametrize("page", PAGES, ids=NAMES)
def test_no_issue_references(page):
    found = re.findall(r"\b(?:[Ii]ssues?|PR|[Pp]ull request)s? ?#\d+", page.read_text(encoding="utf-8"))
    assert not found, f"{page.name} refers to {found[:5]}, which a reader cannot follow"


@pytest.mark.parametrize("page", PAGES, ids=NAMES)
def test_links_and_anchors_resolve(page):
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    for target, anchor in re.findall(r"\]\(([^)#\s]*\.md|)(?:#([^)\s]+))?\)", text):
        if target.startswith(("http://", "https://")):
            continue
        dest = page if not target else (page.parent / target)
        assert dest.is_file(), f"{page.name} links to missing {target}"
        if anchor:
            assert anchor in anchors(dest), f"{page.name} links to {target}#{anchor}, not a heading there"


def test_the_prompting_example_of_models_md_runs_on_an_exported_policy(tmp_path, monkeypatch, capsys):
    """The example that prompts ``final/policy`` with transformers alone, on an exported tiny policy
    (untrained: what it writes is not checked, only that the example runs as shown)."""
    from saorl.models.serialize import export_policy
    from saorl.models.tiny import build_tiny
    from saorl.models.tokenizer import load_tokenizer

    text = (ROOT / "docs" / "models.md").read_text(encoding="utf-8")
    header = "# prompt_policy.py: python prompt_policy.py RUN_DIR/final/policy\n"
    snippet = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if b.startswith(header))
    policy = export_policy(build_tiny("tiny-dense", seed=0), load_tokenizer(), tmp_path / "policy")
    monkeypatch.setattr("sys.argv", ["prompt_policy.py", str(policy)])
    exec(compile(snippet, "docs/models.md", "exec"), {"__name__": "__main__"})
    assert capsys.readouterr().out.startswith("Compute 27*555.\n")
