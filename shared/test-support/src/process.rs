//! Child processes a test runs to completion: the CLI, scripts, SDK clients.

use std::process::Output;

/// Asserts that `out` is a successful exit of `what` and returns its stdout; a failure shows the
/// exit status, the stdout and the stderr.
pub fn success_stdout(out: &Output, what: &str) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}
