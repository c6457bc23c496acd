//! Backend names as NIXL's users write them, resolved against the backends this build's
//! `nixl` offers ([`nixl::Agent::available_backends`]) before anything starts.

/// A backend name resolved for [`nixl::Agent::create_backend`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    /// The name this build knows it by.
    pub name: String,
    /// What the user should know about the choice (a mapped name), if anything.
    pub note: Option<String>,
}

/// NIXL backends this `nixl` does not have, and what does that job here.
const UPSTREAM_ONLY: &[(&str, &str)] = &[
    ("GDS", "storage runs are --backend FILE (feature file)"),
    ("GDS_MT", "storage runs are --backend FILE (feature file)"),
    ("POSIX", "storage runs are --backend FILE (feature file)"),
    (
        "HF3FS",
        "3FS-style storage runs are --backend FILE (feature file), through an hf3fs-gdr daemon",
    ),
    ("OBJ", "there is no object-store backend"),
    ("AZURE_BLOB", "there is no object-store backend"),
    ("INFINIA", "there is no object-store backend"),
    ("GUSLI", "block devices are not supported"),
    ("MOONCAKE", "peer transfers are LIBFABRIC or VERBS"),
    ("UCCL", "peer transfers are LIBFABRIC or VERBS"),
];

/// Which feature of this package brings a backend that is missing from the build.
fn feature_of(name: &str) -> Option<&'static str> {
    match name {
        "CUDA_IPC" | "GPUNETIO" => Some("cuda"),
        "FILE" => Some("file"),
        _ => None,
    }
}

/// Resolves `name` (any case): a backend of this build, or `UCX` (NIXL's default, which
/// this `nixl` does not have) as `LIBFABRIC`, as the Python package `rdma_nixl` maps it.
/// An unknown name is an error that lists the backends there are.
pub fn resolve(name: &str) -> Result<Resolved, String> {
    let available = nixl::Agent::available_backends();
    let upper = name.to_ascii_uppercase();
    let have = |n: &str| available.iter().find(|a| a.eq_ignore_ascii_case(n));
    if upper == "UCX" {
        if let Some(libfabric) = have("LIBFABRIC") {
            return Ok(Resolved {
                name: libfabric.to_string(),
                note: Some(
                    "--backend UCX: this nixl has no UCX; LIBFABRIC runs in its place \
                     (as the rdma_nixl Python package maps it)"
                        .into(),
                ),
            });
        }
    }
    if let Some(found) = have(&upper) {
        return Ok(Resolved {
            name: found.to_string(),
            note: None,
        });
    }
    let list = available.join(", ");
    if let Some(feature) = feature_of(&upper) {
        return Err(format!(
            "--backend {upper}: this build has no {upper}; rebuild with feature {feature} \
             (cargo build --release -p tools --features {feature}); it has {list}"
        ));
    }
    if let Some((_, instead)) = UPSTREAM_ONLY.iter().find(|(n, _)| *n == upper) {
        return Err(format!(
            "--backend {name}: NIXL's {upper} backend is not in this nixl ({instead}); \
             backends here: {list}"
        ));
    }
    Err(format!(
        "--backend {name}: no such backend; this build has {list} (UCX means LIBFABRIC)"
    ))
}

/// Fetches the metadata of the target listening at `addr` until it shows memory this
/// agent's backends reach (a target registers after it starts listening); returns its
/// name. After a minute of none, the error ends with `none_reached` (the flags to check).
pub fn wait_for_target(
    agent: &nixl::Agent,
    addr: std::net::SocketAddr,
    none_reached: &str,
) -> Result<String, String> {
    let start = std::time::Instant::now();
    loop {
        let name = agent
            .fetch_remote_metadata(addr)
            .map_err(|e| format!("fetching the target's metadata from {addr}: {e}"))?;
        if !agent
            .remote_regions(&name)
            .map_err(|e| e.to_string())?
            .is_empty()
        {
            return Ok(name);
        }
        if start.elapsed() > std::time::Duration::from_secs(60) {
            return Err(format!(
                "the target `{name}` at {addr} shows no memory that {none_reached}"
            ));
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_resolve_against_the_build() {
        let available = nixl::Agent::available_backends();
        for name in &available {
            let r = resolve(&name.to_ascii_lowercase()).unwrap();
            assert_eq!(r.name, *name);
            assert_eq!(r.note, None);
        }
        if available.contains(&"LIBFABRIC") {
            let ucx = resolve("ucx").unwrap();
            assert_eq!(ucx.name, "LIBFABRIC");
            assert!(ucx.note.unwrap().contains("LIBFABRIC runs in its place"));
        }
        let e = resolve("FOO").unwrap_err();
        assert!(e.contains("no such backend"), "{e}");
        for name in &available {
            assert!(e.contains(name), "{e} lists {name}");
        }
        let e = resolve("gds").unwrap_err();
        assert!(e.contains("NIXL's GDS backend is not in this nixl"), "{e}");
        assert!(e.contains("--backend FILE"), "{e}");
        if !cfg!(feature = "cuda") {
            let e = resolve("CUDA_IPC").unwrap_err();
            assert!(e.contains("feature cuda"), "{e}");
        }
        if !cfg!(feature = "file") {
            let e = resolve("file").unwrap_err();
            assert!(e.contains("feature file"), "{e}");
        }
    }
}
