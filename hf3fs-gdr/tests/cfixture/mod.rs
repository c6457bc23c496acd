//! Builds the C fixtures of `tests/fixtures` with the system C compiler (`$CC`, else
//! `cc`); tests skip with a printed reason where there is none.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// The fixtures directory.
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// The C compiler, or `None` (with the reason printed) when there is none.
pub fn compiler() -> Option<String> {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    match Command::new(&cc).arg("--version").output() {
        Ok(out) if out.status.success() => Some(cc),
        Ok(out) => {
            println!(
                "SKIP: {cc} --version failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            None
        }
        Err(e) => {
            println!("SKIP: no C compiler ({cc}: {e})");
            None
        }
    }
}

/// Compiles `sources` (in the fixtures directory) with `args` into `out`; panics with
/// the compiler's message on failure.
pub fn compile(cc: &str, sources: &[&str], args: &[&str], out: &Path) {
    let dir = fixtures();
    let output = Command::new(cc)
        .args(sources.iter().map(|s| dir.join(s)))
        .arg("-I")
        .arg(&dir)
        .args(["-std=c11", "-D_GNU_SOURCE", "-Wall", "-Werror", "-o"])
        .arg(out)
        .args(args)
        .output()
        .expect("run the C compiler");
    assert!(
        output.status.success(),
        "{cc} {sources:?} failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}
