#!/usr/bin/env python3
"""Library code a reader can take in: no Rust function over 200 lines, no file over 1,500.

Library code is every crate's src/ (tests/, benches/, examples/ and build.rs excepted; a
`#[cfg(test)] mod tests` block inside src/ counts too, since it is read with the file).
Generated tables are exempt: a file whose first lines say `@generated`. Function length is
from the `fn` line to its closing brace, found by matching braces outside strings, chars and
comments. Prints each offender as `path:line: ...` and exits 1 when there is any.

    scripts/check_code_size.py [--max-fn 200] [--max-file 1500] [ROOT]
"""

import argparse
import re
import sys
from pathlib import Path

FN = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:(?:const|async|unsafe|extern\s+\"[^\"]*\")\s+)*fn\s+(\w+)")


def code_only(text):
    """The text with strings, chars and comments blanked (newlines kept), so braces count."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        nxt = text[i + 1] if i + 1 < n else ""
        if c == "/" and nxt == "/":
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif c == "/" and nxt == "*":
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "r" and re.match(r'r#*"', text[i:i + 300]) and not (i and (text[i - 1].isalnum() or text[i - 1] == "_")):
            hashes = re.match(r'r(#*)"', text[i:]).group(1)
            end = text.find('"' + hashes, i + 2 + len(hashes))
            j = n if end < 0 else end + 1 + len(hashes)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(re.sub(r"[^\n]", " ", text[i:j + 1]))
            i = j + 1
        elif c == "'":
            # A char literal ('x', '\n', '\u{..}'), not a lifetime ('a).
            m = re.match(r"'(\\(?:u\{[0-9a-fA-F]+\}|x[0-9a-fA-F]{2}|.)|[^\\'])'", text[i:i + 12])
            if m:
                out.append(" " * len(m.group(0)))
                i += len(m.group(0))
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def long_functions(text, max_fn):
    """(line, name, length) of each function body longer than max_fn lines."""
    code = code_only(text)
    lines = code.split("\n")
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line) + 1)
    found = []
    for no, line in enumerate(lines):
        m = FN.match(line)
        if not m:
            continue
        # The body's opening brace: the first `{` after the signature, unless a `;` ends it
        # first (a trait method without a body).
        pos = offsets[no] + m.end()
        depth_paren = 0
        while pos < len(code):
            ch = code[pos]
            if ch in "([<":
                depth_paren += 1
            elif ch in ")]>":
                depth_paren -= 1
            elif ch == ";" and depth_paren <= 0:
                pos = -1
                break
            elif ch == "{" and depth_paren <= 0:
                break
            pos += 1
        if pos < 0 or pos >= len(code):
            continue
        depth, end = 0, pos
        while end < len(code):
            if code[end] == "{":
                depth += 1
            elif code[end] == "}":
                depth -= 1
                if depth == 0:
                    break
            end += 1
        start_line = no + 1
        end_line = code.count("\n", 0, end) + 1
        length = end_line - start_line + 1
        if length > max_fn:
            found.append((start_line, m.group(1), length))
    return found


def library_files(root):
    for crate_src in sorted(root.glob("crates/*/src")):
        for path in sorted(crate_src.rglob("*.rs")):
            yield path
    if (root / "src").is_dir():
        yield from sorted((root / "src").rglob("*.rs"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-fn", type=int, default=200)
    ap.add_argument("--max-file", type=int, default=1500)
    ap.add_argument("root", nargs="?", default=Path(__file__).resolve().parent.parent, type=Path)
    args = ap.parse_args()
    offenders = []
    for path in library_files(args.root):
        text = path.read_text(encoding="utf-8", errors="replace")
        if "@generated" in "\n".join(text.splitlines()[:5]):
            continue
        rel = path.relative_to(args.root)
        n_lines = text.count("\n") + (0 if text.endswith("\n") else 1)
        if n_lines > args.max_file:
            offenders.append(f"{rel}:1: file of {n_lines} lines (limit {args.max_file})")
        for line, name, length in long_functions(text, args.max_fn):
            offenders.append(f"{rel}:{line}: fn {name} is {length} lines (limit {args.max_fn})")
    for o in offenders:
        print(o)
    if offenders:
        print(f"{len(offenders)} over the limits: split by step, each step named", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
