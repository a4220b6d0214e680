//! Library crates take their settings as values: only the CLI's one configuration module (and
//! programs' `main`s) read the environment. A new `std::env::var` in a library fails here.

use std::path::{Path, PathBuf};

/// The one module allowed to read the environment.
const CONFIG_MODULE: &str = "crates/hilum-cli/src/config.rs";

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            // Programs may read their environment: `src/bin/*` are binaries.
            if path.file_name().is_some_and(|n| n == "bin") {
                continue;
            }
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs")
            && path.file_name().is_some_and(|n| n != "main.rs")
        {
            out.push(path);
        }
    }
}

/// `env::var`, `env::var_os`, `env::vars`, `env::vars_os` outside comments, as `line: text`.
fn env_reads(text: &str) -> Vec<String> {
    text.lines()
        .enumerate()
        .filter(|(_, line)| {
            let code = line.split("//").next().unwrap_or("");
            code.contains("env::var")
        })
        .map(|(i, line)| format!("{}: {}", i + 1, line.trim()))
        .collect()
}

#[test]
fn library_crates_read_no_environment_variables() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    let crates = std::fs::read_dir(root.join("crates")).expect("crates/");
    for krate in crates.flatten() {
        rust_files(&krate.path().join("src"), &mut files);
    }
    rust_files(&root.join("src"), &mut files);
    assert!(
        files.len() > 50,
        "the scan found only {} files",
        files.len()
    );
    let mut offenders = Vec::new();
    for file in files {
        let rel = file.strip_prefix(root).unwrap_or(&file);
        if rel == Path::new(CONFIG_MODULE) {
            continue;
        }
        let text = std::fs::read_to_string(&file).expect("read source");
        for hit in env_reads(&text) {
            offenders.push(format!("{}:{hit}", rel.display()));
        }
    }
    assert!(
        offenders.is_empty(),
        "library code reads environment variables (move them to {CONFIG_MODULE} and pass the \
         value down):\n{}",
        offenders.join("\n")
    );
}

#[test]
fn the_scan_sees_reads_and_skips_comments() {
    let src = "let a = std::env::var(\"X\");\n// std::env::var(\"Y\")\nlet b = env::var_os(\"Z\");";
    assert_eq!(env_reads(src).len(), 2);
}
