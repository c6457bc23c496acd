//! `cargo xtask msrv`: the `rust-version` the workspace declares is one its lock file
//! really satisfies.
//!
//! No older toolchain can be installed here, so the check reads what every locked
//! package declares (`cargo metadata` with all features, so optional dependencies count):
//! the highest `rust-version` of any dependency must not exceed the workspace's, and every
//! member must declare the workspace's. The Python extension (`python/`, its own lock) is
//! checked the same way.

use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::path::Path;

/// A `major.minor.patch` version; a missing part is 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct RustVersion(u32, u32, u32);

impl RustVersion {
    pub(crate) fn parse(s: &str) -> Option<Self> {
        let mut parts = s.trim().split('.').map(|p| p.parse::<u32>());
        let major = parts.next()?.ok()?;
        let minor = parts.next().unwrap_or(Ok(0)).ok()?;
        let patch = parts.next().unwrap_or(Ok(0)).ok()?;
        if parts.next().is_some() {
            return None;
        }
        Some(Self(major, minor, patch))
    }
}

impl std::fmt::Display for RustVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.0, self.1, self.2)
    }
}

/// What one lock needs against what its members declare.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Findings {
    /// The highest `rust-version` of a non-member package, and that package.
    pub(crate) needed: Option<(RustVersion, String)>,
    /// Members and what they declare (`None`: nothing).
    pub(crate) members: Vec<(String, Option<RustVersion>)>,
}

/// Reads `cargo metadata` output.
pub(crate) fn findings(metadata: &Value) -> Result<Findings> {
    let members: Vec<&str> = metadata["workspace_members"]
        .as_array()
        .context("no workspace_members")?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let mut needed: Option<(RustVersion, String)> = None;
    let mut declared = Vec::new();
    for package in metadata["packages"].as_array().context("no packages")? {
        let name = package["name"].as_str().unwrap_or("?").to_string();
        let id = package["id"].as_str().unwrap_or_default();
        let version = package["rust_version"]
            .as_str()
            .and_then(RustVersion::parse);
        if members.contains(&id) {
            declared.push((name, version));
        } else if let Some(v) = version {
            if needed.as_ref().is_none_or(|(n, _)| v > *n) {
                let label = format!("{name} {}", package["version"].as_str().unwrap_or("?"));
                needed = Some((v, label));
            }
        }
    }
    declared.sort();
    Ok(Findings {
        needed,
        members: declared,
    })
}

/// Problems with `f` (empty: the lock satisfies what the members declare).
pub(crate) fn problems(f: &Findings) -> Vec<String> {
    let mut out = Vec::new();
    for (name, declared) in &f.members {
        match (declared, &f.needed) {
            (None, _) => out.push(format!("{name} declares no rust-version")),
            (Some(d), Some((n, who))) if n > d => out.push(format!(
                "{name} declares rust-version {d}, but {who} needs {n}: raise it to {n}"
            )),
            _ => {}
        }
    }
    let distinct: std::collections::BTreeSet<_> = f.members.iter().filter_map(|m| m.1).collect();
    if distinct.len() > 1 {
        out.push(format!(
            "members declare different rust-versions: {}",
            distinct
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    out
}

fn metadata(root: &Path, manifest: &str) -> Result<Value> {
    crate::test::cargo_metadata(
        root,
        &["--all-features", "--locked", "--manifest-path", manifest],
    )
}

pub fn run(args: &[String]) -> Result<i32> {
    if let Some(arg) = args.first() {
        bail!("msrv takes no arguments (got `{arg}`)");
    }
    let root = crate::bindings::workspace_root();
    let mut failed = false;
    for manifest in ["Cargo.toml", "python/Cargo.toml"] {
        let f = findings(&metadata(&root, manifest)?)?;
        let problems = problems(&f);
        let needed = f
            .needed
            .as_ref()
            .map_or("nothing".to_string(), |(v, who)| format!("{v} ({who})"));
        if problems.is_empty() {
            println!("msrv: {manifest}: the lock needs {needed}; members declare enough");
        } else {
            failed = true;
            for p in problems {
                eprintln!("msrv: {manifest}: {p}");
            }
        }
    }
    Ok(i32::from(failed))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn meta(members: &[(&str, Option<&str>)], deps: &[(&str, Option<&str>)]) -> Value {
        let package = |(name, v): &(&str, Option<&str>)| json!({"name": name, "id": format!("id-{name}"), "version": "1.0.0", "rust_version": v});
        json!({
            "workspace_members": members.iter().map(|(n, _)| format!("id-{n}")).collect::<Vec<_>>(),
            "packages": members.iter().chain(deps).map(package).collect::<Vec<_>>(),
        })
    }

    #[test]
    fn versions_compare_by_number_and_missing_parts_are_zero() {
        assert!(RustVersion::parse("1.88").unwrap() > RustVersion::parse("1.82.9").unwrap());
        assert_eq!(RustVersion::parse("1.88"), RustVersion::parse("1.88.0"));
        assert!(RustVersion::parse("1.100").unwrap() > RustVersion::parse("1.99").unwrap());
        assert_eq!(RustVersion::parse("1.x"), None);
        assert_eq!(RustVersion::parse("1.2.3.4"), None);
    }

    #[test]
    fn a_dependency_needing_more_than_the_members_declare_is_a_problem() {
        let f = findings(&meta(
            &[("a", Some("1.82")), ("b", Some("1.82"))],
            &[
                ("dep", Some("1.88.0")),
                ("old", Some("1.60")),
                ("none", None),
            ],
        ))
        .unwrap();
        assert_eq!(
            f.needed,
            Some((RustVersion(1, 88, 0), "dep 1.0.0".to_string()))
        );
        let p = problems(&f);
        assert_eq!(p.len(), 2, "{p:?}");
        assert!(p[0].contains("raise it to 1.88.0"), "{p:?}");
    }

    #[test]
    fn enough_is_no_problem_but_a_missing_or_different_member_version_is() {
        let ok = findings(&meta(&[("a", Some("1.88"))], &[("dep", Some("1.88"))])).unwrap();
        assert!(problems(&ok).is_empty());
        let mixed = findings(&meta(
            &[("a", Some("1.88")), ("b", Some("1.90")), ("c", None)],
            &[],
        ))
        .unwrap();
        let p = problems(&mixed);
        assert!(p.iter().any(|m| m == "c declares no rust-version"), "{p:?}");
        assert!(
            p.iter().any(|m| m.contains("different rust-versions")),
            "{p:?}"
        );
    }
}
