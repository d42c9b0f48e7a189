//! Finding a `nats-server` binary that is new enough.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// Oldest supported server version (major, minor).
const MIN_VERSION: (u64, u64) = (2, 10);

/// Path of the `nats-server` binary used by the harness.
///
/// Looks at `NATS_SERVER_BIN`, then `<workspace root>/.tools/nats/bin/nats-server`,
/// then `nats-server` on `PATH`. Panics when the binary cannot be run or is older
/// than 2.10. The result is computed once per process.
pub fn nats_server_binary() -> PathBuf {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(find_binary).clone()
}

fn find_binary() -> PathBuf {
    let (path, origin) = if let Some(bin) = std::env::var_os("NATS_SERVER_BIN") {
        (PathBuf::from(bin), "NATS_SERVER_BIN")
    } else {
        let tools = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
            .join(".tools/nats/bin/nats-server");
        if tools.is_file() {
            let tools = tools.canonicalize().unwrap_or(tools);
            (tools, "the workspace .tools directory")
        } else {
            (PathBuf::from("nats-server"), "PATH")
        }
    };
    check_version(&path, origin);
    path
}

fn check_version(path: &Path, origin: &str) {
    let output = match Command::new(path).arg("--version").output() {
        Ok(output) => output,
        Err(err) => panic!(
            "cannot run nats-server at {} (from {origin}): {err}; run `make tools` \
             (or set NATS_SERVER_BIN to a nats-server >= 2.10)",
            path.display()
        ),
    };
    let text = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    match parse_version(&text) {
        Some(version) if version >= MIN_VERSION => {}
        Some((major, minor)) => panic!(
            "nats-server at {} (from {origin}) is v{major}.{minor}, the tests need >= \
             v{}.{}; run `make tools` (or set NATS_SERVER_BIN)",
            path.display(),
            MIN_VERSION.0,
            MIN_VERSION.1
        ),
        None => panic!(
            "cannot read the version of nats-server at {} (from {origin}): {:?}; \
             run `make tools` (or set NATS_SERVER_BIN)",
            path.display(),
            text.trim()
        ),
    }
}

/// Parses `nats-server: v2.15.1` into `(2, 15)`.
fn parse_version(text: &str) -> Option<(u64, u64)> {
    // The first `v` followed by a digit (`nats-server` itself contains a `v`).
    let start = text
        .char_indices()
        .zip(text.chars().skip(1))
        .find(|((_, c), next)| *c == 'v' && next.is_ascii_digit())
        .map(|((i, _), _)| i)?;
    let mut parts = text[start + 1..].split(|c: char| !c.is_ascii_digit());
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

#[cfg(test)]
mod tests {
    use super::parse_version;

    #[test]
    fn parses_versions() {
        assert_eq!(parse_version("nats-server: v2.15.1\n"), Some((2, 15)));
        assert_eq!(parse_version("nats-server: v2.9.10"), Some((2, 9)));
        assert_eq!(parse_version("nats-server: v2.11.0-RC.1"), Some((2, 11)));
        assert_eq!(parse_version("garbage"), None);
        assert!(parse_version("nats-server: v2.9.10").unwrap() < super::MIN_VERSION);
    }
}
