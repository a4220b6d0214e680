#!/usr/bin/env python3
"""Fails when a workspace crate declares a dependency its code never names.

For each package (the crates and the umbrella), every `[dependencies]` entry must be named
(`name::`, `use name`, `name!`, `extern crate name`) in `src/`, `build.rs`, or — for
`[dev-dependencies]` — also in `tests/`, `benches/`, `examples/`. A dependency that is needed
without being named (a codec registry linked for its side effects) is listed, with the reason in
a comment, under `[package.metadata.cargo-machete] ignored = [...]`, the same key cargo-machete reads.
Run from anywhere: `scripts/check_unused_deps.py`.
"""
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def sources(pkg: pathlib.Path, dirs):
    text = []
    for d in dirs:
        p = pkg / d
        if p.is_file():
            text.append(p.read_text(errors="replace"))
        elif p.is_dir():
            for f in p.rglob("*.rs"):
                # Nested packages (the umbrella's crates/) are checked on their own.
                if pkg == ROOT and f.is_relative_to(ROOT / "crates"):
                    continue
                text.append(read_with_path_modules(f))
    return "\n".join(text)


def read_with_path_modules(f: pathlib.Path, seen=None) -> str:
    """A file's text plus the modules it pulls in with `#[path = "..."]` (shared test code)."""
    seen = seen or set()
    if f in seen or not f.is_file():
        return ""
    seen.add(f)
    text = f.read_text(errors="replace")
    parts = [text]
    for rel in re.findall(r'#\[path\s*=\s*"([^"]+)"\]', text):
        target = (f.parent / rel).resolve()
        if target.is_dir():
            target = target / "mod.rs"
        parts.append(read_with_path_modules(target, seen))
        # A `mod.rs` reached by path brings its sibling modules along.
        if target.name == "mod.rs":
            for sib in target.parent.glob("*.rs"):
                parts.append(read_with_path_modules(sib, seen))
    return "\n".join(parts)


def named(ident: str, code: str) -> bool:
    pat = rf"(?<![\w:]){re.escape(ident)}(::|!|\s*;|\s+as\s)|extern\s+crate\s+{re.escape(ident)}\b|use\s+{re.escape(ident)}\b"
    return re.search(pat, code) is not None


def check(manifest: pathlib.Path) -> list[str]:
    pkg = manifest.parent
    doc = tomllib.loads(manifest.read_text())
    if "package" not in doc:
        return []
    ignored = set(
        doc["package"].get("metadata", {}).get("cargo-machete", {}).get("ignored", [])
    )
    lib = sources(pkg, ["src", "build.rs"])
    dev = lib + "\n" + sources(pkg, ["tests", "benches", "examples"])
    problems = []
    for table, code in (("dependencies", lib), ("dev-dependencies", dev)):
        for name, spec in doc.get(table, {}).items():
            if name in ignored:
                continue
            # Code names a dependency by its key (a renamed package too), with `-` as `_`.
            crate = spec.get("package", name) if isinstance(spec, dict) else name
            ident = name.replace("-", "_")
            if not named(ident, code):
                problems.append(f"{manifest.relative_to(ROOT)}: [{table}] `{name}` ({crate}) is never used")
    return problems


def main() -> int:
    manifests = [ROOT / "Cargo.toml"] + sorted((ROOT / "crates").glob("*/Cargo.toml"))
    problems = [p for m in manifests for p in check(m)]
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(
            "error: remove the unused dependencies above, or list a needed-but-unnamed one under "
            "[package.metadata.cargo-machete] ignored with a comment saying why",
            file=sys.stderr,
        )
        return 1
    print(f"unused dependencies: none in {len(manifests)} packages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
