//! The crate's layering, checked on its sources: the agent core imports no backend, a
//! backend reaches the agent only through the backend interface, and backends reach their
//! siblings only through the shared support modules and declared interfaces.
//!
//! Paths are resolved from each file's module (`crate::…`, `super::…`, `self::…`); test
//! code (files named `*tests.rs`, and everything after a top-level `#[cfg(test)]`) and
//! comments are left out, since tests may build agents and docs may link anywhere.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Modules under `backends` that serve several backends.
const SHARED: &[&str] = &[
    "shared",
    "staging",
    "heartbeat",
    "liveness",
    "cuda_copy",
    "ipc_plane",
    "peer_dram",
];
/// The one way a backend may name a sibling: a constructor that returns an interface.
const SIBLING_INTERFACES: &[(&str, &str, &str)] = &[("gpunetio", "cuda_ipc", "open_plane")];
/// The modules that wire the backends to the agent.
const FACADE: &[&str] = &["builtin", "backends"];

/// One file's module path (`["backends", "libfabric", "worker"]`) and the code to check.
struct Source {
    module: Vec<String>,
    path: PathBuf,
    code: String,
}

fn sources() -> Vec<Source> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    walk(&root, &mut files);
    files.sort();
    files
        .into_iter()
        .filter(|p| {
            !p.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .ends_with("tests.rs")
        })
        .map(|path| {
            let rel = path.strip_prefix(&root).unwrap().with_extension("");
            let mut module: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_str().unwrap().to_string())
                .collect();
            if module.last().is_some_and(|m| m == "mod" || m == "lib") {
                module.pop();
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let mut code = String::new();
            for line in text.lines() {
                if line.starts_with("#[cfg(test)]") {
                    break;
                }
                let trimmed = line.trim_start();
                if trimmed.starts_with("//") {
                    continue;
                }
                code.push_str(line);
                code.push('\n');
            }
            Source { module, path, code }
        })
        .collect()
}

/// Every path this source names through `crate::`, `super::` or `self::`, resolved to
/// absolute module segments (`["backends", "cuda_ipc", "open_plane"]`).
fn named_paths(source: &Source) -> BTreeSet<Vec<String>> {
    let mut found = BTreeSet::new();
    let code = &source.code;
    let bytes = code.as_bytes();
    let is_ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    let mut i = 0;
    while i < bytes.len() {
        let start_ok = i == 0 || !(is_ident(bytes[i - 1]) || bytes[i - 1] == b':');
        let rest = &code[i..];
        let root = ["crate::", "super::", "self::"]
            .into_iter()
            .find(|p| rest.starts_with(p));
        let Some(root) = root.filter(|_| start_ok) else {
            i += 1;
            continue;
        };
        // Collect `seg::seg::…` (a `{` group ends it: its first names are enough here,
        // since every group in this crate lists items of one module).
        let mut segments: Vec<String> = Vec::new();
        let mut j = i;
        loop {
            let s = j;
            while j < bytes.len() && is_ident(bytes[j]) {
                j += 1;
            }
            if s == j {
                break;
            }
            segments.push(code[s..j].to_string());
            if code[j..].starts_with("::") {
                j += 2;
            } else {
                break;
            }
        }
        if code[j..].starts_with('{') {
            let end = code[j..].find('}').map_or(code.len(), |e| j + e);
            for item in code[j + 1..end].split(',') {
                let item = item.trim();
                let name: String = item.chars().take_while(|c| is_ident(*c as u8)).collect();
                if !name.is_empty() {
                    let mut with = segments.clone();
                    with.push(name);
                    found.insert(resolve(&source.module, &with));
                }
            }
        } else {
            found.insert(resolve(&source.module, &segments));
        }
        i = j.max(i + root.len());
    }
    found
}

fn resolve(module: &[String], segments: &[String]) -> Vec<String> {
    let mut base: Vec<String> = Vec::new();
    let mut rest = segments;
    match rest.first() {
        Some(s) if s == "crate" => rest = &rest[1..],
        Some(s) if s == "self" => {
            base = module.to_vec();
            rest = &rest[1..];
        }
        Some(s) if s == "super" => {
            base = module.to_vec();
            while rest.first().is_some_and(|s| s == "super") {
                base.pop();
                rest = &rest[1..];
            }
        }
        _ => {}
    }
    base.extend(rest.iter().cloned());
    base
}

fn is_backend_module(module: &[String]) -> Option<&str> {
    match module {
        [b, name, ..] if b == "backends" => Some(name.as_str()),
        _ => None,
    }
}

#[test]
fn the_core_imports_no_backend() {
    let mut offences = Vec::new();
    for source in sources() {
        let top = source.module.first().map(String::as_str).unwrap_or("lib");
        if top == "backends" || FACADE.contains(&top) {
            continue;
        }
        for path in named_paths(&source) {
            if path.first().is_some_and(|p| p == "backends") {
                offences.push(format!("{}: {}", source.path.display(), path.join("::")));
            }
        }
    }
    assert!(
        offences.is_empty(),
        "core modules name backends:\n{}",
        offences.join("\n")
    );
}

#[test]
fn backends_see_the_agent_only_through_the_interface() {
    let mut offences = Vec::new();
    for source in sources() {
        if is_backend_module(&source.module).is_none() {
            continue;
        }
        for path in named_paths(&source) {
            let first = path.first().map(String::as_str);
            if matches!(first, Some("agent" | "Agent" | "AgentConfig" | "builtin")) {
                offences.push(format!("{}: {}", source.path.display(), path.join("::")));
            }
        }
    }
    assert!(
        offences.is_empty(),
        "backends name the agent:\n{}",
        offences.join("\n")
    );
}

#[test]
fn backends_reach_siblings_only_through_shared_support_and_interfaces() {
    let mut offences = Vec::new();
    let mut seen_backends = BTreeSet::new();
    for source in sources() {
        let Some(me) = is_backend_module(&source.module) else {
            continue;
        };
        if SHARED.contains(&me) {
            continue;
        }
        seen_backends.insert(me.to_string());
        for path in named_paths(&source) {
            let Some(other) = is_backend_module(&path) else {
                continue;
            };
            if other == me || SHARED.contains(&other) {
                continue;
            }
            let item = path.get(2).map(String::as_str).unwrap_or("");
            if SIBLING_INTERFACES.contains(&(me, other, item)) {
                continue;
            }
            offences.push(format!("{}: {}", source.path.display(), path.join("::")));
        }
    }
    // The check looked at the backends this build has (LOCAL and FAULT always).
    assert!(seen_backends.contains("local") && seen_backends.contains("fault"));
    assert!(
        offences.is_empty(),
        "backends name siblings:\n{}",
        offences.join("\n")
    );
}

#[test]
fn the_resolver_sees_what_an_offence_looks_like() {
    let source = Source {
        module: vec!["backends".into(), "gpunetio".into(), "nic".into()],
        path: PathBuf::from("x.rs"),
        code: "use super::super::cuda_ipc::{CudaIpcBackend, open_plane};\n\
               let a = crate::agent::Agent::new();\nuse self::inner::X;\n"
            .into(),
    };
    let paths = named_paths(&source);
    assert!(paths.contains(&vec![
        "backends".to_string(),
        "cuda_ipc".into(),
        "CudaIpcBackend".into()
    ]));
    assert!(paths.contains(&vec![
        "backends".to_string(),
        "cuda_ipc".into(),
        "open_plane".into()
    ]));
    assert!(paths.contains(&vec!["agent".to_string(), "Agent".into(), "new".into()]));
    assert!(paths.contains(&vec![
        "backends".to_string(),
        "gpunetio".into(),
        "nic".into(),
        "inner".into(),
        "X".into()
    ]));
}
