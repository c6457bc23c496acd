//! The RDMA devices of this machine, for flags that name one (`--device_list`): a name
//! that is not there is refused before anything starts, in one line that lists what the
//! machine has (instead of a backend that hangs or fails minutes later, after tens of
//! GiB were set up); and the libfabric providers it offers ([`local_providers`]).

use std::path::Path;

/// Where the kernel lists RDMA devices; libibverbs enumerates its devices from sysfs as
/// well, so a device absent here cannot be opened.
const SYSFS_CLASS: &str = "/sys/class/infiniband";

/// The RDMA devices of this machine: those under `/sys/class/infiniband` and those
/// libibverbs lists (the same set where both can be read), sorted, without repeats.
/// Without the sysfs class there is no RDMA subsystem, and libibverbs is not asked
/// (where it has no configuration it prints warnings, which would break a one-line
/// error).
pub fn devices() -> Vec<String> {
    let class = Path::new(SYSFS_CLASS);
    let mut names = sysfs_devices(class);
    if class.is_dir() {
        if let Ok(list) = ibverbs::devices() {
            names.extend(list.iter().map(|d| d.name()));
        }
    }
    names.sort();
    names.dedup();
    names
}

/// The entries of a sysfs device class directory (none where it is absent).
fn sysfs_devices(class: &Path) -> Vec<String> {
    std::fs::read_dir(class)
        .map(|dir| {
            dir.filter_map(|entry| entry.ok())
                .filter_map(|entry| entry.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Checks that `name`, given as `given` (the flag as the user wrote it) for `backend`,
/// is one of `available` (this machine's RDMA devices, [`devices`]); `without` says what
/// the backend does when the flag is left out. The error is one line.
pub fn check_device(
    given: &str,
    name: &str,
    backend: &str,
    available: &[String],
    without: &str,
) -> Result<(), String> {
    if available.iter().any(|d| d == name) {
        return Ok(());
    }
    let has = if available.is_empty() {
        format!("it has none: {SYSFS_CLASS} is empty or absent")
    } else {
        format!("it has {}", available.join(", "))
    };
    Err(format!(
        "{given}: this machine has no RDMA device {name} ({has}); {backend} {without}"
    ))
}

/// Providers on this host that offer RDM endpoints with messages and RMA, as LIBFABRIC
/// asks for them: sorted, without repeats.
pub fn local_providers() -> Vec<String> {
    let infos = fabric::InfoBuilder::new()
        .ep_type(fabric::EndpointType::RDM)
        .caps(fabric::Caps::MSG | fabric::Caps::RMA)
        .get()
        .unwrap_or_default();
    let mut names: Vec<String> = infos
        .iter()
        .map(|i| i.provider_name().to_string())
        .collect();
    names.sort();
    names.dedup();
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_device_is_one_line_naming_what_there_is() {
        let there = vec!["mlx5_1".to_string(), "rxe0".to_string()];
        check_device("--device_list rxe0", "rxe0", "VERBS", &there, "x").unwrap();
        let e = check_device(
            "--device_list mlx5_0",
            "mlx5_0",
            "VERBS",
            &there,
            "needs one",
        )
        .unwrap_err();
        assert_eq!(
            e,
            "--device_list mlx5_0: this machine has no RDMA device mlx5_0 (it has mlx5_1, \
             rxe0); VERBS needs one"
        );
        let e = check_device(
            "--device_list=mlx5_0",
            "mlx5_0",
            "GPUNETIO",
            &[],
            "runs without",
        )
        .unwrap_err();
        assert!(e.contains("it has none") && !e.contains('\n'), "{e}");
    }

    #[test]
    fn sysfs_entries_are_the_directory_names() {
        let dir = std::env::temp_dir().join(format!("rdma-class-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("mlx5_0")).unwrap();
        std::fs::create_dir_all(dir.join("mlx5_3")).unwrap();
        let mut got = sysfs_devices(&dir);
        got.sort();
        assert_eq!(got, ["mlx5_0", "mlx5_3"]);
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(sysfs_devices(&dir).is_empty());
        // This machine's list is whatever it has, and never a panic.
        let _ = devices();
    }
}
