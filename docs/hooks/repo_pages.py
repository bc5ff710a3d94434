"""README.md and BENCHMARKS.md as site pages, and links written for GitHub made to work in the site.

The repository's Markdown is written to be read where it lies (on GitHub or in an editor): the
README links ``docs/methods.md``, a guide page links ``../BENCHMARKS.md#serving``, the benchmark
history links the raw result folders beside it. mkdocs builds only ``docs/``, so this hook

- adds ``README.md`` as the site's ``index.md`` and ``BENCHMARKS.md`` as ``benchmarks.md`` (generated
  files: the text is not copied into ``docs/``);
- rewrites every relative link and image of every page to the site's file for the same repository
  path (``docs/methods.md`` -> ``methods.md``, ``../BENCHMARKS.md`` -> ``benchmarks.md``);
- reads lists and tables as GitHub does (:func:`gfm_blocks`): Python-Markdown wants a blank line
  before a list or a table that follows a paragraph, and 4 spaces, not 2, for what a list item holds;
- turns a link to something the site does not carry (source files, raw result folders, which
  ``exclude_docs`` keeps out) into a link to the repository when ``repo_url`` is set, else into the
  path in code: never a dead link. Images must be in the site (``mkdocs build --strict`` fails
  otherwise).
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

# repository file -> site page
ROOT_PAGES = {"README.md": "index.md", "BENCHMARKS.md": "benchmarks.md"}
LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^)\s]+)(\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def _repo_root(config) -> Path:
    return Path(config.docs_dir).resolve().parent


def on_files(files, config):
    root = _repo_root(config)
    for repo_path, uri in ROOT_PAGES.items():
        files.append(File.generated(config, uri, content=(root / repo_path).read_text()))
    return files


def _repo_path_of(src_uri: str) -> str:
    """The repository path a site page was made from."""
    for repo_path, uri in ROOT_PAGES.items():
        if uri == src_uri:
            return repo_path
    return "docs/" + src_uri


def _site_uri(repo_path: str, files) -> str | None:
    """The site file for a repository path, or None when the site does not carry it."""
    if repo_path in ROOT_PAGES:
        return ROOT_PAGES[repo_path]
    if repo_path.startswith("docs/"):
        f = files.get_file_from_path(repo_path[len("docs/"):])
        if f is not None and not f.inclusion.is_excluded():
            return f.src_uri
    return None


def rewrite(markdown: str, src_uri: str, files, config) -> str:
    """``markdown`` of the page ``src_uri`` with its relative links pointed at the site (module docstring)."""
    page_repo = _repo_path_of(src_uri)
    root = _repo_root(config)
    repo_url = (config.repo_url or "").rstrip("/")

    def fix(m: re.Match) -> str:
        bang, text, url, title = m.group(1), m.group(2), m.group(3), m.group(4) or ""
        if re.match(r"^[a-z][a-z0-9+.-]*:", url) or url.startswith(("#", "/")):
            return m.group(0)
        path, _, anchor = url.partition("#")
        target = posixpath.normpath(posixpath.join(posixpath.dirname(page_repo), path))
        site = _site_uri(target, files)
        if site is not None:
            rel = posixpath.relpath(site, posixpath.dirname(src_uri) or ".")
            return f"{bang}[{text}]({rel}{'#' + anchor if anchor else ''}{title})"
        if bang:  # an image the site lacks: left for mkdocs to report
            return m.group(0)
        is_dir = (root / target).is_dir()
        if repo_url:
            kind = "tree" if is_dir else "blob"
            return f"[{text}]({repo_url}/{kind}/HEAD/{target}{'/' if is_dir else ''}{title})"
        shown = target + ("/" if is_dir else "")
        plain = text.strip("`")
        return f"`{shown}`" if plain.rstrip("/") in (shown.rstrip("/"), path.rstrip("/")) else f"{text} (`{shown}`)"

    out, in_fence = [], False
    for line in markdown.split("\n"):
        if FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence:
            spans = [c.span() for c in re.finditer(r"`[^`]*`", line)]  # links inside code are text

            def fix_outside_code(m: re.Match, spans=spans) -> str:
                return m.group(0) if any(a < m.start() < b for a, b in spans) else fix(m)

            line = LINK.sub(fix_outside_code, line)
        out.append(line)
    return "\n".join(out)


BULLET = re.compile(r"([-*+]|\d+\.)\s")  # a list item, after its indentation


def gfm_blocks(markdown: str) -> str:
    """Lists and tables as GitHub reads them, for Python-Markdown.

    - A bullet list, a list starting at ``1.``, or a table right after a paragraph line gets a blank line
      before it (GitHub lets them interrupt a paragraph; Python-Markdown does not), and so does whatever
      follows a table.
    - What a list item holds is re-indented to Python-Markdown's 4 spaces a level: GitHub nests what is
      indented to the item's text (2 spaces after ``- ``, 3 after ``1. ``), Python-Markdown what is
      indented 4 more than the item. Fenced code inside a list moves with its fence.
    - An item after a block that an item holds below a blank line (a table, a second paragraph) gets a
      blank line before it, or Python-Markdown reads it as that block's text.
    """
    out: list[str] = []
    # open list items, outermost first: (column of the item's text in the source, the same in the output)
    items: list[tuple[int, int]] = []
    prev, fence, shift = "blank", None, 0
    block = False  # inside a list item, a block after a blank line: the next item needs a blank line too
    for line in markdown.split("\n"):
        stripped = line.lstrip(" ")
        indent = len(line) - len(stripped)
        if fence is not None:  # inside fenced code: shifted as its fence was
            out.append(" " * shift + line if line.strip() and shift >= 0 else line)
            if stripped.startswith(fence) and not stripped.strip(fence[0]).strip():
                fence = None
            continue
        if not line.strip():
            out.append(line)
            prev = "blank"
            continue
        item = BULLET.match(stripped)
        if indent == 0 and not item and prev == "blank":
            items, block = [], False  # a paragraph at the margin ends the list
        if item:
            while items and items[-1][0] > indent:
                items.pop()
            if items and indent < items[-1][0]:
                items.pop()
            if items and items[-1][0] <= indent:  # nested under the item still open
                new_indent = items[-1][1]
            else:
                items, new_indent = [], 0
            starts_block = not stripped[0].isdigit() or stripped.startswith("1. ")
            if (new_indent == 0 and starts_block and prev == "text") or prev == "table" or (block and prev != "blank"):
                out.append("")
            block = False
            items.append((indent + item.end(), new_indent + 4))
        else:
            if items and indent and prev == "blank":
                block = True
            holder = [c for c in items if c[0] <= indent]
            if holder:
                new_indent = holder[-1][1] + indent - holder[-1][0]
            elif items and indent:
                new_indent = items[0][1]  # under-indented text inside an item: its continuation
            else:
                new_indent = indent
            if (stripped.startswith("|") and prev == "text" and not items) or (prev == "table" and not stripped.startswith("|")):
                out.append("")
        shift = new_indent - indent
        if stripped.startswith(("```", "~~~")):
            fence = stripped[:3]
        out.append(" " * new_indent + stripped)
        prev = "table" if stripped.startswith("|") else ("list" if items else "text")
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:
    return rewrite(gfm_blocks(markdown), page.file.src_uri, files, config)
