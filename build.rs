//! Builds the web page (`web/`, docs/web.md) that `cyrene web` and `cyrene up` serve, into
//! `$OUT_DIR/web`, where `src/cli/web.rs` embeds it: no bundle is ever copied by hand or checked
//! in, so a fresh clone's `cargo build` builds it. Needs Node.js and npm; the npm packages are
//! installed from `web/package-lock.json` (`npm ci`) the first time and whenever the lock file
//! changes.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let root = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    let web = root.join("web");
    for input in [
        "src",
        "index.html",
        "build.mjs",
        "package.json",
        "package-lock.json",
    ] {
        println!("cargo:rerun-if-changed=web/{input}");
    }
    let out = PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default()).join("web");
    if let Err(problem) = build(&web, &out) {
        eprintln!(
            "error: cannot build the web page (web/, docs/web.md) that the cyrene binary embeds:\n  \
             {problem}\n  It needs Node.js (>= 18) and npm: `apt-get install nodejs npm`, or run \
             `make web`, which installs them."
        );
        std::process::exit(1);
    }
}

fn build(web: &Path, out: &Path) -> Result<(), String> {
    let installed = web.join("node_modules/.package-lock.json");
    let lock = web.join("package-lock.json");
    if modified(&installed) < modified(&lock) {
        run(Command::new("npm")
            .args(["ci", "--no-audit", "--no-fund", "--loglevel=error"])
            .current_dir(web))?;
    }
    run(Command::new("node")
        .arg("build.mjs")
        .arg(out)
        .current_dir(web))
}

fn modified(path: &Path) -> Option<std::time::SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

fn run(command: &mut Command) -> Result<(), String> {
    let shown = format!("{command:?}");
    let status = command
        .status()
        .map_err(|e| format!("{shown} could not start: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{shown} failed ({status})"))
    }
}
