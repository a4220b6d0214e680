//! Helpers shared by the CLI's integration tests.

use std::process::Command;

/// Creates a `hilum serve` token named `ws` in `db` with `cmd` (a `hilum` command with the
/// test's environment) and returns it.
pub fn create_token(mut cmd: Command, db: &str, admin: bool) -> String {
    cmd.args(["serve", "token", "create", "--name", "ws", "--db", db]);
    if admin {
        cmd.arg("--admin");
    }
    let out = cmd.output().expect("token create");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}
