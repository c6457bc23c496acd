//! Finding host memory the daemon can map itself: a shared mapping of a file under
//! `/dev/shm` (read from `/proc/self/maps`), and fresh iov ids to publish it under.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

/// A shared `/dev/shm` file mapping holding a registered range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ShmMapping {
    /// The file.
    pub(super) path: PathBuf,
    /// Where the file's offset 0 would be in this process (the iov base the daemon's
    /// offsets count from).
    pub(super) base: u64,
    /// Bytes from `base` to the end of the mapping.
    pub(super) size: u64,
}

/// The shared `/dev/shm` mapping that holds all of `[addr, addr + len)`, if one does.
pub(super) fn find(addr: u64, len: u64) -> Option<ShmMapping> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines().find_map(|line| parse_line(line, addr, len))
}

/// One `/proc/self/maps` line (`start-end perms offset dev inode path`) if it is a
/// shared mapping of a live `/dev/shm` file that contains the range.
fn parse_line(line: &str, addr: u64, len: u64) -> Option<ShmMapping> {
    let mut fields = line.split_whitespace();
    let (start, end) = fields.next()?.split_once('-')?;
    let (start, end) = (
        u64::from_str_radix(start, 16).ok()?,
        u64::from_str_radix(end, 16).ok()?,
    );
    let perms = fields.next()?;
    let offset = u64::from_str_radix(fields.next()?, 16).ok()?;
    let _dev = fields.next()?;
    let _inode = fields.next()?;
    let path: Vec<&str> = fields.collect();
    let path = path.join(" ");
    let inside = start <= addr && addr.checked_add(len).is_some_and(|e| e <= end);
    let shared = perms.as_bytes().get(3) == Some(&b's');
    let in_shm = path.starts_with("/dev/shm/") && !path.ends_with(" (deleted)");
    if !(inside && shared && in_shm && offset <= start) {
        return None;
    }
    Some(ShmMapping {
        path: PathBuf::from(path),
        base: start - offset,
        size: offset + (end - start),
    })
}

/// A 16-byte id nobody else picks: this process, a counter, the time and the address.
pub(super) fn fresh_id(addr: u64) -> hf3fs_gdr::Id {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut id = [0u8; 16];
    id[..4].copy_from_slice(&std::process::id().to_le_bytes());
    id[4..8].copy_from_slice(&COUNTER.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    id[8..].copy_from_slice(&(nanos ^ addr.rotate_left(32)).to_le_bytes());
    id
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_lines_are_read_for_shared_shm_files_only() {
        let line = "7f0000001000-7f0000005000 rw-s 00002000 00:19 77 /dev/shm/seg a";
        let m = parse_line(line, 0x7f00_0000_2000, 0x1000).unwrap();
        assert_eq!(m.path, PathBuf::from("/dev/shm/seg a"));
        assert_eq!(
            (m.base, m.size),
            (0x7f00_0000_1000 - 0x2000, 0x2000 + 0x4000)
        );
        // Outside, past the end, private, another directory, deleted.
        assert!(parse_line(line, 0x7f00_0000_0000, 16).is_none());
        assert!(parse_line(line, 0x7f00_0000_4000, 0x1001).is_none());
        let private = line.replace("rw-s", "rw-p");
        assert!(parse_line(&private, 0x7f00_0000_2000, 16).is_none());
        let tmp = line.replace("/dev/shm/", "/tmp/");
        assert!(parse_line(&tmp, 0x7f00_0000_2000, 16).is_none());
        let deleted = format!("{line} (deleted)");
        assert!(parse_line(&deleted, 0x7f00_0000_2000, 16).is_none());
        assert!(parse_line("garbage", 0, 1).is_none());
    }

    #[test]
    fn ids_differ() {
        assert_ne!(fresh_id(1), fresh_id(1));
    }

    #[test]
    fn a_real_shm_mapping_is_found_and_heap_memory_is_not() {
        let name = format!("/dev/shm/nixl-file-test-{}", std::process::id());
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&name)
            .unwrap();
        file.set_len(1 << 16).unwrap();
        use std::os::fd::AsRawFd;
        // SAFETY: a fresh shared mapping of the file, unmapped below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                1 << 16,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED);
        let m = find(ptr as u64 + 100, 1000).unwrap();
        assert_eq!(m.base, ptr as u64);
        assert_eq!(m.size, 1 << 16);
        assert_eq!(m.path, PathBuf::from(&name));
        let heap = vec![0u8; 4096];
        assert!(find(heap.as_ptr() as u64, 4096).is_none());
        // SAFETY: mapped above.
        unsafe { libc::munmap(ptr, 1 << 16) };
        std::fs::remove_file(&name).unwrap();
    }
}
