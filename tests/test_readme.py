"""The README and docs/ hold together: the README stays a short front page (at most 10,000
characters, with the status table that says what ran where), every relative link in the README
and in docs/ reaches a file (and a heading, when it names one), every docs page is on the
README's map, and docs/config.md's list of flags is the parser's.

``python tests/test_readme.py`` rewrites docs/config.md's generated flag list."""

import dataclasses
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
CONFIG_MD = ROOT / "docs" / "config.md"
README_LIMIT = 10_000
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FLAGS_BEGIN, FLAGS_END = "<!-- flags: begin -->", "<!-- flags: end -->"
SENTENCE_END = re.compile(r"(?<!e\.g)(?<!i\.e)(?<=[a-z0-9)`])\. ")
"""Where a docstring's first sentence ends (not at "e.g." or "i.e.")."""


def test_readme_is_at_most_10000_characters():
    n = len(README.read_bytes())  # as wc -c counts
    assert n <= README_LIMIT, f"README.md has {n} bytes (at most {README_LIMIT}): move text " \
                              f"to a docs/ page"


def test_the_status_table_names_what_ran_and_what_did_not():
    """One table says where the code ran, in place of a 'not run' clause by every GPU
    statement: each configuration is a row of the README's status section."""
    status = README.read_text().split("\n## Status", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in status.splitlines() if line.startswith("|")]
    for what in ("gloo", "0.16.1", "0.19.2", "CUDA", "Transformer Engine", "H20",
                 "tensor parallelism"):
        assert any(what in row for row in rows), f"no status row names {what!r}"
    assert any("not run" in row for row in rows)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces
    to '-'."""
    text = heading.strip().lstrip("#").strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text, fenced, out = page.read_text(), False, set()
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.add(slug(line))
    return out


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` whose file, or heading, does not exist."""
    out = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            out.append(f"{page.name}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{page.name}: {target} (no heading #{anchor} in {dest.name})")
    return out


def test_every_link_of_the_readme_and_docs_resolves():
    broken = [b for page in [README, *DOCS] for b in broken_links(page)]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "b.md").write_text("# Real heading\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#real-heading) [gone](c.md) [bad](b.md#nothing) [web](https://x)"
                    " [self](#top)\n\n# Top\n")
    assert broken_links(page) == ["a.md: c.md (no such file)",
                                  "a.md: b.md#nothing (no heading #nothing in b.md)"]


def test_slug_is_githubs():
    assert slug("## The demo (`make demo`)") == "the-demo-make-demo"
    assert slug("## 5. Beyond one device, and the schedule's contract") == \
        "5-beyond-one-device-and-the-schedules-contract"


def test_every_docs_page_is_on_the_readmes_map():
    linked = {(README.parent / t.partition("#")[0]).resolve()
              for t in LINK.findall(README.read_text())}
    missing = [page.name for page in DOCS if page.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


def flag_table() -> str:
    """docs/config.md's list of every flag, by section: flag, type, built-in default, the
    first sentence of its docstring."""
    from scalerlt_mcore.app.config.library import field_docs, to_dict
    from scalerlt_mcore.app.config.run import KEYS, RunConfig
    from scalerlt_mcore.app.config.values import type_name

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    builtin, out = to_dict(RunConfig()), []
    for section in dataclasses.fields(RunConfig):
        out += [f"**{section.name}**", "", "| flag | type | default | what |", "|---|---|---|---|"]
        for key, doc in field_docs(section.default_factory).items():
            first = SENTENCE_END.split(" ".join(doc.split()))[0].rstrip(".")
            out.append(f"| `--{key.replace('_', '-')}` | {cell(type_name(KEYS[key][1]))} | "
                       f"`{cell(repr(builtin[key]))}` | {cell(first)} |")
        out.append("")
    return "\n".join(out)


def _with_flag_table(text: str) -> str:
    head, rest = text.split(FLAGS_BEGIN, 1)
    return f"{head}{FLAGS_BEGIN}\n{flag_table()}{FLAGS_END}{rest.split(FLAGS_END, 1)[1]}"


def test_config_md_lists_every_flag():
    text = CONFIG_MD.read_text()
    assert text == _with_flag_table(text), \
        "docs/config.md's flag list differs from the parser's: run python tests/test_readme.py"


def test_the_flag_table_has_every_flag_once():
    from scalerlt_mcore.app.config.parsing import cli_flags

    listed = re.findall(r"^\| `(--[a-z0-9-]+)` \|", flag_table(), flags=re.M)
    assert sorted(listed) == sorted(set(cli_flags()) - {"--config", "--help"})


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    CONFIG_MD.write_text(_with_flag_table(CONFIG_MD.read_text()))
