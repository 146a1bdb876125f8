"""What a reader of README.md and docs/ can follow: no paths of the machine the docs were written
on, no references to an issue tracker the reader cannot see, and no link to an anchor that is not
there.

The rules:

- ``/work/``, ``/root/`` and ``/home/`` never appear (they name one machine's directories);
- ``/tmp/`` appears only inside code (a fenced block or backticks), where a scratch directory in
  an example command is legitimate, and never as ``--out /tmp/...`` (where a measurement was
  written: ``runs/measure/NAME`` instead);
- no ``issue #N``, ``PR #N``, ``issue N``, ``the NAME issue`` or bare ``#N`` outside code, links
  and URLs: the docs stand on their own;
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


def machine_paths(text: str) -> list[str]:
    """The paths of one machine ``text`` names: ``/work/``, ``/root/``, ``/home/`` anywhere, ``/tmp/``
    outside code, and ``--out /tmp/...`` (where a measurement was written) even in code."""
    path = r"[^\s)`'\"]*"
    return [
        *re.findall(rf"(?<![\w.~-])/(?:work|root|home)/{path}", text),
        *re.findall(rf"(?<![\w.~-])/tmp/{path}", _without_code(text)),
        *re.findall(rf"--out[ =]+/tmp/{path}", text),
    ]


def issue_references(text: str) -> list[str]:
    """References to an issue tracker in ``text``: ``issue #N``, ``PR #N``, ``issue N``, ``the NAME
    issue``, and a bare ``#N`` outside code, link targets and URLs (headings, ``(#anchor)`` links
    and hex colours are not references)."""
    prose = re.sub(r"\]\([^)\s]*\)|<[^>\n]*>|https?://\S+", "", _without_code(text))
    return [
        *re.findall(r"\b(?:[Ii]ssues?|PR|[Pp]ull request)s? ?#\d+", text),
        *re.findall(r"\b[Tt]he [\w-]+ issue\b", text),
        *re.findall(r"\b[Ii]ssues? \d+\b", text),
        *re.findall(r"(?<![\w&#/])#\d+(?![\w-])", prose),
    ]


def test_machine_paths_are_found():
    assert machine_paths("saved under /work/main/runs") == ["/work/main/runs"]
    assert machine_paths("written with `saorl bench pipeline --out /tmp/perf/bq3`") == ["--out /tmp/perf/bq3"]
    assert machine_paths("    saorl bench pipeline --out=/tmp/bq  # 1.5 min\n") == ["--out=/tmp/bq"]
    assert machine_paths("loose /tmp/x here") == ["/tmp/x"]
    assert not machine_paths("a session directory (`/tmp/saorl-ray-*`); `--out runs/measure/bq3`")


def test_issue_references_are_found():
    for probe in ("see issue #12", "PR #3", "as in issue 7", "(the real-model issue)", "measured in #5 with"):
        assert issue_references(probe), probe
    clean = (
        "# Performance\n## 2 ranks\nsee [packing](#the-trainer-at-the-speed-of-its-tokens) or "
        "[a](results.md#1-steps), colour #3a3a3a, `#2`, <a id=\"x-1\">, "
        "https://github.com/o/r/blob/main/README.md#L12, a known issue, 1,000 issues"
    )
    assert not issue_references(clean), issue_references(clean)


@pytest.mark.parametrize("page", PAGES, ids=NAMES)
def test_no_machine_paths(page):
    found = machine_paths(page.read_text(encoding="utf-8"))
    assert not found, f"{page.name} names directories of one machine: {found[:5]}"


@pytest.mark.parametrize("page", PAGES, ids=NAMES)
def test_no_issue_references(page):
    found = issue_references(page.read_text(encoding="utf-8"))
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


@pytest.mark.parametrize("page", PAGES, ids=NAMES)
def test_every_relative_link_names_a_file_that_exists(page):
    """Images, scripts, configs and directories too, not only pages (whose anchors the test above
    checks)."""
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    missing = [t for t in re.findall(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)", text)
               if not t.startswith(("http://", "https://", "mailto:")) and not (page.parent / t).exists()]
    assert not missing, f"{page.name} links to files that do not exist: {missing[:5]}"


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
