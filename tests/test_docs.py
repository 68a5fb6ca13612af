"""The docs: MkDocs builds the pages under docs/ in strict mode (a broken link or anchor is an error), and every
relative link and anchor of README.md and docs/*.md lands on a file and a heading that exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from conftest import PROJECT_ROOT

PAGES = [PROJECT_ROOT / "README.md", *sorted((PROJECT_ROOT / "docs").glob("*.md"))]
FENCED = re.compile(r"^```.*?^```", re.M | re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, as MkDocs makes them (Python-Markdown's toc slugify)."""
    from markdown.extensions.toc import slugify

    text = FENCED.sub("", page.read_text())
    return {slugify(h, "-") for h in re.findall(r"^#{1,6} +(.+?) *#*$", text, re.M)}


def links(page: Path) -> list[str]:
    """The relative links of a page, outside its code blocks (a web address is not checked here)."""
    return [
        t
        for t in LINK.findall(FENCED.sub("", page.read_text()))
        if not re.match(r"[a-z][a-z0-9+.-]*:", t)
    ]


def broken_links(pages: list[Path]) -> list[str]:
    broken = []
    for page in pages:
        for target in links(page):
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.is_file():
                broken.append(f"{page.name}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.name}: {target}: no heading #{anchor} in {dest.name}")
    return broken


def test_every_relative_link_and_anchor_resolves():
    assert sum(len(links(p)) for p in PAGES) > 30  # the checker sees the links
    assert broken_links(PAGES) == []


def test_a_broken_link_or_anchor_is_found(tmp_path):
    (tmp_path / "a.md").write_text(
        "# A page\n\n## Some part\n\n```\n[x](nowhere.md)\n```\n"
        "[ok](#some-part) [ok](b.md#b) [bad](b.md#c) [bad](c.md) [web](https://x.org)\n"
    )
    (tmp_path / "b.md").write_text("# B\n")
    assert broken_links([tmp_path / "a.md"]) == [
        "a.md: b.md#c: no heading #c in b.md",
        "a.md: c.md: no such file",
    ]


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(config),
            "--site-dir",
            str(site),
        ],
        capture_output=True,
        text=True,
        cwd=config.parent,
    )


def test_the_docs_build_in_strict_mode(tmp_path):
    checkout_site = PROJECT_ROOT / "site"
    before = checkout_site.stat().st_mtime_ns if checkout_site.exists() else None
    proc = build(PROJECT_ROOT / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode == 0, proc.stderr
    built = {p.parent.name or p.stem for p in (tmp_path / "site").rglob("index.html")}
    assert {p.stem for p in PAGES[1:]} - {"index"} <= built  # every page is in the site
    after = checkout_site.stat().st_mtime_ns if checkout_site.exists() else None
    assert after == before  # nothing written into the checkout


def test_strict_mode_fails_on_a_broken_anchor(tmp_path):
    """The check above can fail: the same configuration over a copy with one anchor broken is refused."""
    import shutil

    shutil.copytree(PROJECT_ROOT / "docs", tmp_path / "docs")
    shutil.copy2(PROJECT_ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    page = tmp_path / "docs" / "configs.md"
    page.write_text(page.read_text().replace("(#your-own-text)", "(#your-own-txt)"))
    proc = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode != 0 and "your-own-txt" in proc.stderr, proc.stderr


def test_the_readme_is_read_in_minutes():
    """At most 200 lines: the rest lives in the pages, each of which the README links."""
    readme = (PROJECT_ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert {f"docs/{p.name}" for p in PAGES[1:] if p.name != "index.md"} <= set(
        links(PROJECT_ROOT / "README.md")
    )


def test_every_key_a_stage_is_tuned_by_is_on_the_stages_page():
    """Each key of a shipped stage that its YAML sets to a value of its own (not `order`, not a `${...}` another
    section sets) is named on docs/stages.md as the override that tunes it (`stages.best_val.keep`)."""
    from conftest import config_of
    from omegaconf import OmegaConf

    from pipeline.config.compose import CONFIG_DIR

    text = (PROJECT_ROOT / "docs" / "stages.md").read_text()
    config = config_of("+stages/early_stop=default")
    yaml = CONFIG_DIR / "stages"  # each stage as its YAML writes it (interpolations unresolved)
    stages = {
        **OmegaConf.to_container(OmegaConf.load(yaml / "default.yaml")),
        "early_stop": OmegaConf.to_container(OmegaConf.load(yaml / "early_stop" / "default.yaml")),
    }
    tuned = [
        f"stages.{name}.{key}"
        for name, node in stages.items()
        if isinstance(node, dict)
        for key, value in node.items()
        if key not in ("_target_", "order", "defaults")
        and not (isinstance(value, str) and value.startswith("${"))
        and key in config["stages"][name]
    ]
    assert "stages.best_val.keep" in tuned and "stages.early_stop.patience" in tuned
    assert not [k for k in tuned if k not in text], [k for k in tuned if k not in text]
