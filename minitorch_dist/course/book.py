"""Chapter 00 — the book as a website: chapters, executed notebooks, figures, formulas and the
cheatsheet as one static HTML site, with every source file the prose names one click away.

``make book`` (``python -m minitorch_dist.course.book [--out DIR]``) assembles a docs folder in
``build/book-src`` and builds it with MkDocs, the Material theme and mkdocs-jupyter into ``build/book``.
Read it through any local web server (``python -m http.server -d build/book``: search needs one), or
open ``build/book/index.html`` from disk (all but search). What the assembly does to the prose:

- a relative link to a file of the repository outside the book (``../minitorch_dist/memory/zero/fsdp.py``,
  ``../tests/test_zero.py``, a folder such as ``../minitorch_dist/kernels/``) points at a generated page
  that shows that file's source with line numbers (a folder: a list of its files);
- inline code naming a top-level function or class of the library that only one module defines
  (``fully_shard``, ``ShardedOptimizer``, ``comm.all_reduce``) links to its line on that page;
- TeX between ``$$`` (or ``$``) becomes MathML at build time: the browser typesets it, no script needed;
- ``<details>`` answers get ``markdown="1"``, so the Markdown inside them is rendered.

Notebooks are not executed: the site shows their committed outputs. The build is strict (a broken link
or a missing figure fails it; ``tests/test_book.py`` checks every anchor of the built site too), needs no
network, and the site loads nothing from another host:
MkDocs' hooks (the ``on_*`` functions below) drop the notebook template's MathJax and Mermaid loaders,
which point at a CDN. The one exception to strictness is a link to a chapter not written yet (a
``chapters/NN_*.md`` that does not exist): it stays as text, and the build says so.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE = "code"  # the docs folder that holds the source pages
CHAPTER = re.compile(r"^\d\d_\w+\.md$")
FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
MD_LINK = re.compile(r"\[[^\]\n]*\]\([^)\s]*\)")
LINK_TARGET = re.compile(r"(\]\()([^)\s]+)(\))")
DISPLAY_MATH = re.compile(r"\$\$(.+?)\$\$", re.S)
INLINE_MATH = re.compile(r"(?<![\\$\w])\$(?=\S)([^$\n]+?)(?<=\S)\$(?![\d$])")
NAME = re.compile(r"^([A-Za-z_][\w.]*)(?:\(.*\))?$")


# --- what the library defines ---------------------------------------------------------------------------

def library_names(root: Path = ROOT) -> dict[str, tuple[str, int]]:
    """Top-level public functions and classes that exactly one library module defines (the course's own
    machinery aside), each with its file (relative to ``root``) and line: ``{"fully_shard": (path, 284)}``."""
    found: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for path in sorted((root / "minitorch_dist").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("minitorch_dist/course/") or path.name == "__main__.py":
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                found[node.name].append((rel, node.lineno))
    return {name: where[0] for name, where in found.items() if len(where) == 1}


def resolve_name(code: str, names: dict[str, tuple[str, int]]) -> tuple[str, int] | None:
    """The definition an inline code span names, or None: ``fully_shard``, ``fully_shard(model)``, or a
    dotted ``comm.all_reduce`` whose leading parts are the tail of the defining module's dotted path."""
    m = NAME.match(code.strip())
    if not m:
        return None
    *prefix, name = m.group(1).split(".")
    where = names.get(name)
    if where is None or not prefix:
        return where
    parts = where[0].removesuffix(".py").split("/")
    n = len(prefix)
    spans = [parts[i:i + n] for i in range(len(parts) - n + 1)]
    return where if prefix in spans else None


# --- rewriting one page's Markdown ----------------------------------------------------------------------

class Rewriter:
    """Rewrites the Markdown of one page, found at ``src`` in the repository and placed at ``dest`` in the
    docs folder. ``ext`` is what a link to a generated source page ends in: ``.md`` from a Markdown page
    (MkDocs turns it into the page's URL and checks it), ``.html`` from a notebook (nbconvert does not)."""

    def __init__(self, src: Path, dest: str, ext: str, names: dict[str, tuple[str, int]],
                 linked: set[str], root: Path = ROOT):
        self.src, self.dest, self.ext, self.names, self.linked = src, dest, ext, names, linked
        self.root = root
        self.up = "../" * dest.count("/")  # from the page's folder back to the docs root

    def page(self, text: str) -> str:
        """Everything but fenced code blocks is prose."""
        out: list[str] = []
        prose: list[str] = []
        fence = ""
        for line in text.splitlines(keepends=True):
            m = FENCE.match(line)
            if fence:
                out.append(line)
                fence = "" if m and m.group(1).startswith(fence) else fence
            elif m:
                out += [self.prose("".join(prose)), line]
                prose, fence = [], m.group(1)
            else:
                prose.append(line)
        return "".join(out) + self.prose("".join(prose))

    def prose(self, text: str) -> str:
        links = [m.span() for m in MD_LINK.finditer(text)]
        out, pos = [], 0
        for m in CODE_SPAN.finditer(text):
            out.append(self.plain(text[pos:m.start()]))
            line_start = text.rfind("\n", 0, m.start()) + 1
            in_link = any(a <= m.start() and m.end() <= b for a, b in links)
            heading = text.startswith("#", line_start)
            out.append(m.group(0) if in_link or heading else self.code_span(m.group(0), m.group(2)))
            pos = m.end()
        return "".join(out) + self.plain(text[pos:])

    def plain(self, text: str) -> str:
        text = DISPLAY_MATH.sub(lambda m: to_mathml(m.group(1), "block"), text)
        text = INLINE_MATH.sub(lambda m: to_mathml(m.group(1), "inline"), text)
        text = re.sub(r"<details>", '<details markdown="1">', text)
        return LINK_TARGET.sub(lambda m: m.group(1) + self.target(m.group(2)) + m.group(3), text)

    def code_span(self, span: str, code: str) -> str:
        where = resolve_name(code, self.names)
        if where is None:
            return span
        self.linked.add(where[0])
        return f"[{span}]({self.up}{CODE}/{where[0]}{self.ext}#__codelineno-0-{where[1]})"

    def target(self, href: str) -> str:
        """A link's new target: a source page for a file of the repository outside the book."""
        if re.match(r"^(\w+:|#|/)", href):
            return href
        path, _, anchor = href.partition("#")
        file = (self.src.parent / path).resolve()
        try:
            rel = file.relative_to(self.root).as_posix()
        except ValueError:
            return href
        if rel.startswith(("chapters/", "notebooks/")) or not file.exists():
            return href
        self.linked.add(rel)
        page = f"{rel.rstrip('/')}/index" if file.is_dir() else rel
        return f"{self.up}{CODE}/{page}{self.ext}" + (f"#{anchor}" if anchor else "")


def to_mathml(tex: str, display: str) -> str:
    """TeX to MathML, typeset by the browser itself (MathML Core): no script, nothing fetched."""
    from latex2mathml.converter import convert

    return convert(tex.strip(), display=display)


def unwritten_chapter_links(text: str, chapters: Path) -> tuple[str, list[str]]:
    """Links to a chapter file that does not exist yet become their text; returns the text and the names."""
    missing: list[str] = []

    def unlink(m: re.Match) -> str:
        if CHAPTER.match(m.group(2)) and not (chapters / m.group(2)).exists():
            missing.append(m.group(2))
            return m.group(1)
        return m.group(0)

    return re.sub(r"(?<!!)\[([^\]\n]*)\]\(([^)\s#]+)(?:#[^)\s]*)?\)", unlink, text), missing


# --- the docs folder ------------------------------------------------------------------------------------

def title_of(text: str) -> str:
    """A chapter's navigation label from its first heading: '06 · ZeRO and FSDP'."""
    h1 = next((line[2:].strip() for line in text.splitlines() if line.startswith("# ")), "")
    m = re.match(r"Chapter (\d+) — (.*)", h1)
    if not m:
        return h1
    head, _, _ = m.group(2).partition(":")
    return f"{m.group(1)} · {m.group(2) if head.strip() == 'Appendix' else head.strip()}"


def write_chapters(docs: Path, names: dict, linked: set[str], root: Path = ROOT) -> list[dict]:
    """Chapters and the cheatsheet, rewritten, with their figures; returns their navigation entries."""
    src_dir, out = root / "chapters", docs / "chapters"
    shutil.copytree(src_dir / "figures", out / "figures")
    nav = []
    for src in sorted(p for p in src_dir.glob("*.md") if CHAPTER.match(p.name)) + [src_dir / "cheatsheet.md"]:
        text, missing = unwritten_chapter_links(src.read_text(encoding="utf-8"), src_dir)
        for name in sorted(set(missing)):
            print(f"book: {src.name} links {name}, not written yet: kept as text")
        rewriter = Rewriter(src, f"chapters/{src.name}", ".md", names, linked, root)
        (out / src.name).write_text(rewriter.page(text), encoding="utf-8")
        nav.append({title_of(text) if src.name != "cheatsheet.md" else "Cheatsheet": f"chapters/{src.name}"})
    return nav


def write_notebooks(docs: Path, names: dict, linked: set[str], root: Path = ROOT) -> list[dict]:
    """The notebooks with their committed outputs; only their Markdown cells are rewritten."""
    (docs / "notebooks").mkdir(parents=True)
    nav = []
    for src in sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        nb = json.loads(src.read_text(encoding="utf-8"))
        rewriter = Rewriter(src, f"notebooks/{src.name}", ".html", names, linked, root)
        for cell in nb["cells"]:
            if cell["cell_type"] == "markdown":
                cell["source"] = rewriter.page("".join(cell["source"]))
        (docs / "notebooks" / src.name).write_text(json.dumps(nb), encoding="utf-8")
        first = "".join(nb["cells"][0]["source"]) if nb["cells"] else src.stem
        nav.append({title_of(first) or src.stem: f"notebooks/{src.name}"})
    return nav


def write_sources(docs: Path, linked: set[str], root: Path = ROOT) -> None:
    """One page per linked file: its source, highlighted, with a linkable number on every line; a linked
    folder gets a page listing its files (which get pages too). Full width, and kept out of the search."""
    files = {rel for rel in linked if (root / rel).is_file()}
    for rel in sorted(linked - files):
        folder = root / rel
        members = sorted(p.relative_to(root).as_posix() for p in folder.glob("*.py"))
        files |= set(members)
        items = "\n".join(f"- [`{Path(m).name}`]({Path(m).name}.md)" for m in members)
        page = docs / CODE / rel.rstrip("/") / "index.md"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(f"# `{rel.rstrip('/')}/`\n\n{items}\n", encoding="utf-8")
    for rel in sorted(files):
        text = (root / rel).read_text(encoding="utf-8")
        fence = "`" * max(3, 1 + max((len(r) for r in re.findall(r"`+", text)), default=0))
        lang = "python" if rel.endswith(".py") else "text"
        page = docs / CODE / f"{rel}.md"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(f"---\nsearch:\n  exclude: true\nhide: [navigation, toc]\n---\n\n# `{rel}`\n\n"
                        f'{fence}{lang} linenums="1"\n{text}\n{fence}\n', encoding="utf-8")
    listing = "\n".join(f"- [`{rel}`]({rel}.md)" for rel in sorted(files))
    (docs / CODE / "index.md").write_text(f"# Source files\n\nThe files the chapters link to.\n\n{listing}\n",
                                          encoding="utf-8")


def write_index(docs: Path, chapters: list[dict], notebooks: list[dict], root: Path = ROOT) -> None:
    """The home page: the README's opening paragraph and the table of contents."""
    readme = (root / "README.md").read_text(encoding="utf-8").split("\n\n")
    intro = next((p for p in readme[1:] if p.strip() and not p.startswith("#")), "")
    nb_of = {Path(path).name[:2]: path for entry in notebooks for path in entry.values()}
    rows = [f"| [{label}]({path}) | " + (f"[notebook]({nb_of[Path(path).name[:2]]})"
                                         if Path(path).name[:2] in nb_of else "") + " |"
            for entry in chapters for label, path in entry.items()]
    (docs / "index.md").write_text(
        "# minitorch_dist\n\n" + intro + "\n\n| chapter | notebook |\n|---|---|\n" + "\n".join(rows)
        + f"\n\nThe library's source: [the files the chapters link to]({CODE}/index.md).\n", encoding="utf-8")


def config(src: Path, out: Path, nav: list) -> dict:
    """mkdocs.yml: Material without web fonts, its built-in search, notebooks as they were committed, and
    page URLs that are files (``chapters/06_zero_fsdp.html``), so that the site also opens from disk."""
    return {
        "site_name": "minitorch_dist", "docs_dir": str(src / "docs"), "site_dir": str(out),
        "use_directory_urls": False, "strict": True, "nav": nav,
        "theme": {"name": "material", "font": False,
                  "features": ["navigation.footer", "navigation.top", "search.highlight"]},
        "plugins": ["search",
                    {"mkdocs-jupyter": {"include": ["*.ipynb"], "ignore": ["*.md"], "execute": False,
                                        "ignore_h1_titles": True,
                                        "cache_dir": str(src / ".cache")}}],
        "markdown_extensions": ["tables", "attr_list", "md_in_html", {"toc": {"permalink": True}},
                                {"pymdownx.highlight": {"anchor_linenums": True}}, "pymdownx.superfences"],
        "hooks": [str(Path(__file__).resolve())],
        "validation": {"nav": {"omitted_files": "ignore"},
                       "links": {"not_found": "warn", "anchors": "ignore", "unrecognized_links": "warn"}},
    }


def assemble(src: Path, out: Path, root: Path = ROOT) -> Path:
    """Write ``src/docs`` and ``src/mkdocs.yml``; returns the latter."""
    import yaml  # MkDocs' own dependency

    docs = src / "docs"
    shutil.rmtree(docs, ignore_errors=True)
    docs.mkdir(parents=True)
    names, linked = library_names(root), set[str]()
    chapters = write_chapters(docs, names, linked, root)
    notebooks = write_notebooks(docs, names, linked, root)
    write_sources(docs, linked, root)
    write_index(docs, chapters[:-1], notebooks, root)
    nav = [{"Home": "index.md"}, {"Chapters": chapters[:-1]}, chapters[-1],
           {"Notebooks": notebooks}, {"Source files": f"{CODE}/index.md"}]
    path = src / "mkdocs.yml"
    path.write_text(yaml.safe_dump(config(src, out, nav), sort_keys=False, allow_unicode=True),
                    encoding="utf-8")
    return path


def build(out: Path, src: Path | None = None, timeout_s: float = 600) -> Path:
    """Assemble and build the site into ``out``; returns ``out``. Raises if MkDocs fails."""
    src = src or ROOT / "build" / "book-src"
    cfg = assemble(src.resolve(), out.resolve())
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # a banner about the theme's future, on every build
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--clean", "--config-file", str(cfg)]
    subprocess.run(command, check=True, timeout=timeout_s, env=env)
    return out


# --- MkDocs hooks (mkdocs.yml names this file) ------------------------------------------------------------

SCRIPT = re.compile(r"<script\b[^>]*>.*?</script>", re.S)


def on_page_content(html: str, page, **kwargs) -> str:
    """A notebook page keeps no script that would fetch from another host: nbconvert's template loads
    MathJax and Mermaid from a CDN (the formulas are MathML already, and there are no diagrams)."""
    if not page.file.src_uri.endswith(".ipynb"):
        return html

    def keep(m: re.Match) -> str:
        s = m.group(0)
        fetches = "http://" in s or "https://" in s or 'src=""' in s or "text/x-mathjax-config" in s
        return "" if fetches else s

    ids = re.findall(r'<h[1-6][^>]*\sid="([^"]+)"', html)
    _match_toc(page.toc, ids)
    return SCRIPT.sub(keep, html)


def _match_toc(toc, ids: list[str]) -> None:
    """mkdocs-jupyter derives a notebook's table of contents from its Markdown, where a heading's inline code
    is dropped from the slug ('measured-the-tiny-gpt-under'), and its headings from nbconvert, where it is
    kept ('measured-the-tiny-gpt-under-memorymeter'): point each entry at its heading."""
    for item in toc:
        if item.id not in ids:
            item.id = next((i for i in ids if i.startswith(item.id + "-")), item.id)
        _match_toc(item.children, ids)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build the book: chapters, notebooks, cheatsheet, as a website.")
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "book", help="the site (default build/book)")
    ap.add_argument("--src", type=Path, default=ROOT / "build" / "book-src",
                    help="where to assemble the docs folder and mkdocs.yml (default build/book-src)")
    args = ap.parse_args(argv)
    try:
        build(args.out, args.src)
    except subprocess.CalledProcessError as e:
        print(f"book: MkDocs failed (exit {e.returncode}); see above", file=sys.stderr)
        return 1
    print(f"book: built {args.out.resolve()}; read it with: python -m http.server -d {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
