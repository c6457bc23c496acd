//! Which host a peer is on, exactly enough for `shm`: the kernel's boot id, the pid
//! namespace and the mount namespace (or the `/dev/shm` it sees).
//!
//! `shm` needs both processes to see one `/dev/shm` (its regions are files there), and
//! for large messages (`process_vm_readv`, CMA) the peer's pid must name the same
//! process here: the same pid namespace. A process in a network and pid namespace of its
//! own on the same kernel (the netns tests) shows the same boot id, so the boot id alone
//! says too much. Two processes are on the same host for `shm` when their boot ids and
//! pid namespaces are equal, and their mount namespaces — or, between mount namespaces,
//! the `/dev/shm` directories (device and inode) — are too. Anything unreadable makes a
//! process on another host: the network reaches it.

use super::super::shared::boot_id;
use crate::error::{Error, Result};
use std::os::unix::fs::MetadataExt;

/// Boot id, pid namespace (device, inode), mount namespace (device, inode), `/dev/shm`
/// present, its device and inode.
pub(super) const WIRE_SIZE: usize = 16 + 16 + 16 + 1 + 16;

/// Where a process runs, as far as `shm` cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct HostId {
    boot_id: [u8; 16],
    pid_ns: (u64, u64),
    mnt_ns: (u64, u64),
    /// `/dev/shm`'s device and inode, where it exists.
    dev_shm: Option<(u64, u64)>,
}

impl HostId {
    /// This process; `None` where `/proc` does not say. Not cached: a forked child may
    /// have entered other namespaces.
    pub(super) fn current() -> Option<Self> {
        let ns = |name: &str| {
            std::fs::metadata(format!("/proc/self/ns/{name}"))
                .ok()
                .map(|m| (m.dev(), m.ino()))
        };
        Some(HostId {
            boot_id: boot_id()?,
            pid_ns: ns("pid")?,
            mnt_ns: ns("mnt")?,
            dev_shm: std::fs::metadata("/dev/shm")
                .ok()
                .filter(std::fs::Metadata::is_dir)
                .map(|m| (m.dev(), m.ino())),
        })
    }

    /// Whether `shm` reaches a process at `other` from one at `self`.
    pub(super) fn shares_memory_with(&self, other: &HostId) -> bool {
        self.boot_id == other.boot_id
            && self.pid_ns == other.pid_ns
            && self.dev_shm.is_some()
            && (self.mnt_ns == other.mnt_ns || self.dev_shm == other.dev_shm)
    }

    pub(super) fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.boot_id);
        for v in [self.pid_ns.0, self.pid_ns.1, self.mnt_ns.0, self.mnt_ns.1] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.push(u8::from(self.dev_shm.is_some()));
        let (dev, ino) = self.dev_shm.unwrap_or_default();
        out.extend_from_slice(&dev.to_le_bytes());
        out.extend_from_slice(&ino.to_le_bytes());
    }

    /// Exactly [`WIRE_SIZE`] bytes.
    pub(super) fn decode(b: &[u8]) -> Result<Self> {
        let bad = |why: &str| {
            Error::MalformedMetadata(format!("LIBFABRIC connection info: host identity {why}"))
        };
        if b.len() != WIRE_SIZE {
            return Err(bad("has the wrong size"));
        }
        let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        let dev_shm = match b[48] {
            0 => None,
            1 => Some((u64_at(49), u64_at(57))),
            _ => return Err(bad("has a bad /dev/shm flag")),
        };
        Ok(HostId {
            boot_id: b[..16].try_into().expect("16 bytes"),
            pid_ns: (u64_at(16), u64_at(24)),
            mnt_ns: (u64_at(32), u64_at(40)),
            dev_shm,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_round_trips_and_bad_blocks_are_typed_errors() {
        let me = HostId::current().expect("/proc answers on Linux");
        let mut wire = Vec::new();
        me.encode(&mut wire);
        assert_eq!(wire.len(), WIRE_SIZE);
        assert_eq!(HostId::decode(&wire).unwrap(), me);
        for cut in 0..wire.len() {
            assert!(matches!(
                HostId::decode(&wire[..cut]),
                Err(Error::MalformedMetadata(_))
            ));
        }
        let mut flag = wire.clone();
        flag[48] = 2;
        assert!(matches!(
            HostId::decode(&flag),
            Err(Error::MalformedMetadata(_))
        ));
        let mut none = me;
        none.dev_shm = None;
        let mut wire = Vec::new();
        none.encode(&mut wire);
        assert_eq!(HostId::decode(&wire).unwrap(), none);
    }

    #[test]
    fn same_host_needs_boot_pid_namespace_and_dev_shm() {
        let me = HostId::current().unwrap();
        assert!(me.shares_memory_with(&me));
        let other_boot = HostId {
            boot_id: [me.boot_id[0] ^ 1; 16],
            ..me
        };
        assert!(!me.shares_memory_with(&other_boot));
        // The netns tests' target: same kernel, a pid namespace of its own.
        let other_pid_ns = HostId {
            pid_ns: (me.pid_ns.0, me.pid_ns.1 + 1),
            ..me
        };
        assert!(!me.shares_memory_with(&other_pid_ns));
        // Another mount namespace that sees the same /dev/shm: shared.
        let other_mnt_ns = HostId {
            mnt_ns: (me.mnt_ns.0, me.mnt_ns.1 + 1),
            ..me
        };
        assert!(me.shares_memory_with(&other_mnt_ns));
        // ... but not with a /dev/shm of its own.
        let own_shm = HostId {
            dev_shm: me.dev_shm.map(|(d, i)| (d + 1, i)),
            ..other_mnt_ns
        };
        assert!(!me.shares_memory_with(&own_shm));
        let no_shm = HostId {
            dev_shm: None,
            ..me
        };
        assert!(!no_shm.shares_memory_with(&me));
    }
}
