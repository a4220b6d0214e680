#!/usr/bin/env python3
"""Check the relative links of Hilum's documentation.

Reads README.md, CHANGELOG.md and every docs/*.md (paths relative to the repository root, the
folder above this script) and checks each relative Markdown link:

- `[text](path)` and `![alt](path)`: the file or folder must exist, relative to the linking file
  (a path starting with `/` is relative to the repository root, as on GitHub);
- `[text](path.md#anchor)`: the target must also hold a heading whose GitHub-style slug is
  `anchor` (or an HTML `id=`/`name=` attribute with that value);
- `[text](#anchor)`: the same, in the linking file itself;
- reference definitions `[label]: path` are checked the same way.

Links with a scheme (`http:`, `https:`, `mailto:`, ...) are skipped, and so is anything inside
fenced or indented code blocks and inline code spans. Each broken link is printed as
`FILE:LINE: ...`; the exit status is 1 when any link is broken. On success it prints
`doc links: N checked, 0 broken`.

Standard library only. Usage: scripts/check_doc_links.py [FILE.md ...] (default: the files above).
"""

import os
import re
import sys
import unicodedata
from urllib.parse import unquote

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
INLINE_LINK = re.compile(r"!?\[((?:[^\[\]\\]|\\.|\[[^\[\]]*\])*)\]\(\s*(<[^>]*>|[^\s)]+)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REF_DEF = re.compile(r"^ {0,3}\[([^\]]+)\]:\s*(<[^>]*>|\S+)")
HTML_ID = re.compile(r"""<[^>]*\s(?:id|name)\s*=\s*["']([^"']+)["']""", re.I)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)


def default_files():
    files = ["README.md", "CHANGELOG.md"]
    docs = os.path.join(ROOT, "docs")
    if os.path.isdir(docs):
        files += sorted(
            os.path.join("docs", name) for name in os.listdir(docs) if name.endswith(".md")
        )
    return [f for f in files if os.path.isfile(os.path.join(ROOT, f))]


def prose_lines(text):
    """Yields (line number, line) for lines outside fenced and indented code blocks."""
    fence = None
    prev_blank = True
    in_indented = False
    for number, line in enumerate(text.split("\n"), start=1):
        if fence is not None:
            stripped = line.strip()
            if stripped.startswith(fence) and set(stripped) == {fence[0]}:
                fence = None
            prev_blank = False
            continue
        m = FENCE.match(line)
        if m:
            fence = m.group(1)
            in_indented = False
            prev_blank = False
            continue
        blank = line.strip() == ""
        indented = line.startswith("    ") or line.startswith("\t")
        if indented and not blank and (prev_blank or in_indented):
            in_indented = True
            prev_blank = False
            continue
        if not blank:
            in_indented = False
        prev_blank = blank
        yield number, line


def strip_code_spans(line):
    return CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)


def heading_text_to_slug(text):
    """GitHub's heading anchor: rendered text, lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"(^|\s)_+|_+(\s|$)", r"\1\2", text)  # _emphasis_ markers, not snake_case
    text = text.strip().lower()
    kept = []
    for ch in text:
        if ch in "-_ " or ch.isalnum() or unicodedata.category(ch).startswith("M"):
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


def anchors_of(path, cache={}):
    """Every anchor a Markdown file defines: heading slugs (with GitHub's -1, -2 for repeats)
    and HTML id/name attributes."""
    if path in cache:
        return cache[path]
    with open(path, encoding="utf-8") as f:
        text = f.read()
    anchors = set()
    counts = {}

    def add(slug):
        n = counts.get(slug, 0)
        counts[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")

    previous = None
    for _, line in prose_lines(text):
        for m in HTML_ID.finditer(line):
            anchors.add(m.group(1))
        m = ATX.match(line)
        if m:
            add(heading_text_to_slug(m.group(2) or ""))
            previous = None
            continue
        if previous and SETEXT.match(line) and not ATX.match(previous):
            if not previous.lstrip().startswith(("|", "-", "*", "+", ">")):
                add(heading_text_to_slug(previous))
                previous = None
                continue
        previous = line if line.strip() else None
    cache[path] = anchors
    return anchors


def links_in(text):
    """Yields (line number, target) for every inline link and reference definition."""
    for number, line in prose_lines(text):
        line = strip_code_spans(line)
        m = REF_DEF.match(line)
        if m:
            yield number, m.group(2)
            continue
        for m in INLINE_LINK.finditer(line):
            yield number, m.group(2)


def check_link(source, target):
    """None when the link resolves, else why it does not."""
    if target.startswith("<") and target.endswith(">"):
        target = target[1:-1]
    path, _, anchor = target.partition("#")
    path = unquote(path)
    anchor = unquote(anchor)
    if path == "":
        dest = source
    elif path.startswith("/"):
        dest = os.path.join(ROOT, path.lstrip("/"))
    else:
        dest = os.path.join(os.path.dirname(source), path)
    dest = os.path.normpath(dest)
    if not os.path.exists(dest):
        return f"no such file: {os.path.relpath(dest, ROOT)}"
    if anchor and dest.endswith(".md") and os.path.isfile(dest):
        if anchor not in anchors_of(dest):
            return f"no heading with anchor #{anchor} in {os.path.relpath(dest, ROOT)}"
    return None


def main(argv):
    files = argv[1:] or default_files()
    checked = 0
    broken = 0
    for name in files:
        source = os.path.normpath(os.path.join(ROOT, name))
        with open(source, encoding="utf-8") as f:
            text = f.read()
        for number, target in links_in(text):
            if SCHEME.match(target.strip("<")):
                continue
            checked += 1
            problem = check_link(source, target)
            if problem:
                broken += 1
                print(f"{os.path.relpath(source, ROOT)}:{number}: broken link ({target}): {problem}")
    print(f"doc links: {checked} checked, {broken} broken")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
