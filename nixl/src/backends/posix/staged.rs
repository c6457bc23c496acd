//! VRAM on the memory side of a `POSIX` transfer: `pread`/`pwrite` cannot reach device
//! memory, so VRAM descriptors go through pinned host slots, as the other backends
//! stage VRAM (the staging module's bounce memory and copier: `cuMemcpyAsync` on the
//! GPU's streams, completed by events).
//!
//! A run of consecutive VRAM descriptors of a transfer is cut into pieces of at most one
//! slot, pipelined over the slots:
//! - READ: `pread` a piece into slot `k mod slots`, start its copy slot → VRAM, go on
//!   with the next piece; a slot is read into again only once its copy completed, so the
//!   file reads of later pieces overlap the copies of earlier ones.
//! - WRITE: copies VRAM → slot are started for the first `slots` pieces; each piece is
//!   `pwrite`n once its copy completed, and its slot then takes the copy of the piece
//!   `slots` further on, so copies run ahead of the file writes.
//!
//! A failure stops the run after every copy already started has finished (a copy cannot
//! be recalled, and the memory it touches may be released once the transfer reports).

use super::{Io, IoOutcome};
use crate::backend::XferOp;
use crate::backends::staging::{BounceMem, Copier, CopyOp};
use crate::error::Error;

/// A slot of the staging memory and the piece it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Piece {
    /// The descriptor (index in the run) the piece is of.
    pub(super) io: usize,
    /// Byte offset of the piece in the descriptor.
    pub(super) offset: usize,
    pub(super) len: usize,
}

/// `ios`' pieces of at most `slot` bytes, in order (a descriptor of 0 bytes has none).
pub(super) fn plan_pieces(ios: &[Io], slot: usize) -> Vec<Piece> {
    let slot = slot.max(1);
    let mut pieces = Vec::new();
    for (i, io) in ios.iter().enumerate() {
        let mut offset = 0;
        while offset < io.len {
            let len = slot.min(io.len - offset);
            pieces.push(Piece { io: i, offset, len });
            offset += len;
        }
    }
    pieces
}

/// The pinned slots of a transfer and the copier that fills and drains them: made on
/// the transfer's first post with VRAM, kept for its reposts.
#[derive(Debug)]
pub(super) struct Stager {
    copier: Box<dyn Copier>,
    bounce: BounceMem,
    slot: usize,
    slots: usize,
}

fn gpu_failure(e: Error) -> (i32, String) {
    (libc::EIO, format!("staging through pinned memory: {e}"))
}

impl Stager {
    /// `slots` slots of `slot` bytes, allocated by `copier` (pinned for GPU `gpu`:
    /// portable, so copies of other GPUs use them at pinned speed too).
    pub(super) fn new(
        mut copier: Box<dyn Copier>,
        gpu: usize,
        slot: usize,
        slots: usize,
    ) -> std::result::Result<Self, (i32, String)> {
        let (slot, slots) = (slot.max(1), slots.max(1));
        let bounce = copier.alloc(slot * slots, Some(gpu)).map_err(gpu_failure)?;
        Ok(Self {
            copier,
            bounce,
            slot,
            slots,
        })
    }

    fn slot_addr(&self, slot: usize) -> usize {
        self.bounce.ptr() as usize + slot * self.slot
    }

    /// Waits for a copy to complete.
    fn wait(&mut self, ticket: u64) -> IoOutcome {
        while !self.copier.poll(ticket).map_err(gpu_failure)? {
            std::thread::yield_now();
        }
        Ok(())
    }

    /// Waits for every copy still running (their outcome no longer matters: the run
    /// failed already), so that none touches memory after the run reports.
    fn drain(&mut self, tickets: &mut [Option<u64>]) {
        for ticket in tickets.iter_mut().filter_map(Option::take) {
            while let Ok(false) = self.copier.poll(ticket) {
                std::thread::yield_now();
            }
        }
    }

    /// The copy between piece `p` (of VRAM descriptor `ios[p.io]`) and slot `slot`.
    fn copy_op(&self, op: XferOp, ios: &[Io], p: Piece, slot: usize) -> CopyOp {
        let vram = ios[p.io].mem as u64 + p.offset as u64;
        let host = self.slot_addr(slot) as u64;
        match op {
            XferOp::Read => CopyOp {
                dst: vram,
                src: host,
                len: p.len,
            },
            XferOp::Write => CopyOp {
                dst: host,
                src: vram,
                len: p.len,
            },
        }
    }

    fn start(
        &mut self,
        op: XferOp,
        ios: &[Io],
        p: Piece,
        slot: usize,
    ) -> Result<u64, (i32, String)> {
        let copy = self.copy_op(op, ios, p, slot);
        self.copier
            .start(ios[p.io].gpu, &[copy])
            .map_err(gpu_failure)
    }

    /// The file I/O of piece `p` to or from slot `slot`.
    fn file_io(&self, op: XferOp, ios: &[Io], p: Piece, slot: usize) -> IoOutcome {
        let io = &ios[p.io];
        Io {
            fd: io.fd,
            offset: io.offset + p.offset as libc::off_t,
            mem: self.slot_addr(slot),
            len: p.len,
            gpu: None,
        }
        .run(op)
    }

    /// Moves `ios` (VRAM descriptors: `mem` is a device address of GPU `gpu`) through
    /// the slots; returns once every piece is in place (READ: in VRAM, WRITE: in the file).
    pub(super) fn run(&mut self, op: XferOp, ios: &[Io]) -> IoOutcome {
        let pieces = plan_pieces(ios, self.slot);
        let mut tickets: Vec<Option<u64>> = vec![None; self.slots];
        let result = match op {
            XferOp::Read => self.read(ios, &pieces, &mut tickets),
            XferOp::Write => self.write(ios, &pieces, &mut tickets),
        };
        if result.is_err() {
            self.drain(&mut tickets);
        }
        result
    }

    fn read(&mut self, ios: &[Io], pieces: &[Piece], tickets: &mut [Option<u64>]) -> IoOutcome {
        for (k, &p) in pieces.iter().enumerate() {
            let slot = k % self.slots;
            if let Some(t) = tickets[slot].take() {
                self.wait(t)?;
            }
            self.file_io(XferOp::Read, ios, p, slot)?;
            tickets[slot] = Some(self.start(XferOp::Read, ios, p, slot)?);
        }
        for ticket in tickets.iter_mut().filter_map(Option::take) {
            self.wait(ticket)?;
        }
        Ok(())
    }

    fn write(&mut self, ios: &[Io], pieces: &[Piece], tickets: &mut [Option<u64>]) -> IoOutcome {
        for (k, &p) in pieces.iter().enumerate().take(self.slots) {
            tickets[k] = Some(self.start(XferOp::Write, ios, p, k)?);
        }
        for (k, &p) in pieces.iter().enumerate() {
            let slot = k % self.slots;
            if let Some(t) = tickets[slot].take() {
                self.wait(t)?;
            }
            self.file_io(XferOp::Write, ios, p, slot)?;
            if let Some(&next) = pieces.get(k + self.slots) {
                tickets[slot] = Some(self.start(XferOp::Write, ios, next, slot)?);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backends::staging::HostCopier;
    use std::collections::HashMap;
    use std::io::{Read, Seek, SeekFrom, Write};
    use std::os::fd::AsRawFd;

    /// A copier that stands in for a GPU: copies host memory (the "VRAM" is a host
    /// buffer), but only when a ticket is polled for the `delay`-th time, so that a run
    /// that reused a slot before its copy completed, or reported before every copy
    /// ended, is caught by the data.
    #[derive(Debug)]
    struct SlowCopier {
        delay: u32,
        next: u64,
        pending: HashMap<u64, (u32, Vec<CopyOp>)>,
        fail_at: Option<u64>,
        started: u64,
    }

    impl SlowCopier {
        fn new(delay: u32) -> Self {
            Self {
                delay,
                next: 0,
                pending: HashMap::new(),
                fail_at: None,
                started: 0,
            }
        }
    }

    impl Copier for SlowCopier {
        fn alloc(&mut self, len: usize, _dev: Option<usize>) -> crate::error::Result<BounceMem> {
            HostCopier::default().alloc(len, None)
        }
        fn start(&mut self, dev: Option<usize>, copies: &[CopyOp]) -> crate::error::Result<u64> {
            assert!(dev.is_some(), "staged pieces are copied on their GPU");
            self.started += 1;
            if self.fail_at == Some(self.started) {
                return Err(Error::Gpu("injected copy failure".into()));
            }
            self.next += 1;
            self.pending.insert(self.next, (0, copies.to_vec()));
            Ok(self.next)
        }
        fn poll(&mut self, ticket: u64) -> crate::error::Result<bool> {
            let Some((polls, _)) = self.pending.get_mut(&ticket) else {
                return Ok(true);
            };
            *polls += 1;
            if *polls < self.delay {
                return Ok(false);
            }
            let (_, copies) = self.pending.remove(&ticket).expect("present");
            // SAFETY: the test's buffers and the stager's slots, alive for the run.
            unsafe { crate::backends::staging::host_copy(&copies) };
            Ok(true)
        }
    }

    fn temp_file(len: usize) -> std::fs::File {
        let mut f = tempfile();
        f.write_all(&vec![0u8; len]).unwrap();
        f
    }

    fn tempfile() -> std::fs::File {
        let dir = std::env::temp_dir();
        let path = dir.join(format!(
            "nixl-posix-staged-{}-{}",
            std::process::id(),
            crate::backends::shared::random_u64()
        ));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        f
    }

    fn pattern(n: usize, seed: u64) -> Vec<u8> {
        (0..n as u64)
            .map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed) >> 3) as u8)
            .collect()
    }

    /// A "VRAM" descriptor: `len` bytes at `mem + at`, file offset `offset`.
    fn io(fd: i32, offset: usize, mem: *mut u8, at: usize, len: usize) -> Io {
        Io {
            fd,
            offset: offset as libc::off_t,
            mem: mem as usize + at,
            len,
            gpu: Some(0),
        }
    }

    #[test]
    fn pieces_cover_every_descriptor_in_slot_sized_steps() {
        let ios: Vec<Io> = [0usize, 1, 4096, 4097, 10_000]
            .iter()
            .map(|&len| Io {
                fd: 0,
                offset: 0,
                mem: 0,
                len,
                gpu: Some(0),
            })
            .collect();
        let pieces = plan_pieces(&ios, 4096);
        let by_io = |i| -> Vec<(usize, usize)> {
            pieces
                .iter()
                .filter(|p| p.io == i)
                .map(|p| (p.offset, p.len))
                .collect()
        };
        assert!(by_io(0).is_empty(), "0 bytes: no piece");
        assert_eq!(by_io(1), [(0, 1)]);
        assert_eq!(by_io(2), [(0, 4096)]);
        assert_eq!(by_io(3), [(0, 4096), (4096, 1)]);
        assert_eq!(by_io(4), [(0, 4096), (4096, 4096), (8192, 1808)]);
        assert!(pieces.windows(2).all(|w| w[0].io <= w[1].io), "in order");
    }

    /// Many descriptors of odd sizes at odd offsets, more pieces than slots, both ways,
    /// with copies that complete late: every byte lands where it belongs, and nothing
    /// outside the descriptors is touched.
    #[test]
    fn write_then_read_many_odd_descriptors_through_few_slots() {
        for (slot, slots, delay) in [(4096, 2, 3), (1000, 3, 1), (7, 1, 2), (1 << 20, 4, 5)] {
            let file_len = 64 << 10;
            let file = temp_file(file_len);
            let fd = file.as_raw_fd();
            let mut src = pattern(40_000, 7);
            // (file offset, memory offset, length): odd sizes and offsets, one empty.
            let layout = [
                (3usize, 1usize, 1usize),
                (17, 5, 4095),
                (5000, 4100, 4097),
                (9999, 9000, 12_345),
                (30_001, 22_000, 0),
                (40_000, 25_000, 15_000),
            ];
            let writes: Vec<Io> = layout
                .iter()
                .map(|&(f, m, l)| io(fd, f, src.as_mut_ptr(), m, l))
                .collect();
            let mut stager = Stager::new(Box::new(SlowCopier::new(delay)), 0, slot, slots).unwrap();
            stager.run(XferOp::Write, &writes).unwrap();
            let mut on_disk = vec![0u8; file_len];
            (&file).seek(SeekFrom::Start(0)).unwrap();
            (&file).read_exact(&mut on_disk).unwrap();
            let mut want = vec![0u8; file_len];
            for &(f, m, l) in &layout {
                want[f..f + l].copy_from_slice(&src[m..m + l]);
            }
            assert!(
                on_disk == want,
                "file after WRITE (slot {slot}, {slots} slots)"
            );

            let mut dst = vec![0xEEu8; src.len()];
            let reads: Vec<Io> = layout
                .iter()
                .map(|&(f, m, l)| io(fd, f, dst.as_mut_ptr(), m, l))
                .collect();
            stager.run(XferOp::Read, &reads).unwrap();
            let mut want = vec![0xEEu8; src.len()];
            for &(_, m, l) in &layout {
                want[m..m + l].copy_from_slice(&src[m..m + l]);
            }
            assert!(
                dst == want,
                "memory after READ (slot {slot}, {slots} slots)"
            );
        }
    }

    /// A transfer mixing DRAM and "VRAM" descriptors: DRAM ones go straight to the file,
    /// each run of VRAM ones through the slots, in order, every descriptor counted once.
    #[test]
    fn a_transfer_mixing_dram_and_vram_runs_each_its_way() {
        use super::super::{Runner, StagingConfig};
        use std::sync::atomic::{AtomicU64, Ordering};

        let file = temp_file(1 << 16);
        let fd = file.as_raw_fd();
        let mut src = pattern(1 << 15, 9);
        let at = src.as_mut_ptr();
        let dram = |f: usize, m: usize, l: usize| Io {
            gpu: None,
            ..io(fd, f, at, m, l)
        };
        // (file offset, memory offset, length, VRAM?)
        let layout = [
            (0usize, 0usize, 100usize, false),
            (200, 100, 5000, true),
            (6000, 5100, 3, true),
            (7000, 5103, 4097, false),
            (12_000, 9200, 9000, true),
        ];
        let ios: Vec<Io> = layout
            .iter()
            .map(|&(f, m, l, v)| {
                if v {
                    io(fd, f, at, m, l)
                } else {
                    dram(f, m, l)
                }
            })
            .collect();
        let mut runner = Runner::new(StagingConfig {
            slot: 4096,
            slots: 2,
        });
        runner.stager = Some(Stager::new(Box::new(SlowCopier::new(3)), 0, 4096, 2).unwrap());
        let done = AtomicU64::new(0);
        runner.run_all(XferOp::Write, &ios, &done).unwrap();
        assert_eq!(done.load(Ordering::Relaxed), layout.len() as u64);
        for &(f, m, l, _) in &layout {
            let mut got = vec![0u8; l];
            std::os::unix::fs::FileExt::read_exact_at(&file, &mut got, f as u64).unwrap();
            assert!(got == src[m..m + l], "file at {f}");
        }
        let mut dst = vec![0u8; src.len()];
        let back = dst.as_mut_ptr();
        let reads: Vec<Io> = ios
            .iter()
            .map(|io| Io {
                mem: io.mem - at as usize + back as usize,
                ..*io
            })
            .collect();
        done.store(0, Ordering::Relaxed);
        runner.run_all(XferOp::Read, &reads, &done).unwrap();
        assert_eq!(done.load(Ordering::Relaxed), layout.len() as u64);
        for &(_, m, l, _) in &layout {
            assert!(dst[m..m + l] == src[m..m + l], "memory at {m}");
        }
    }

    #[test]
    fn a_read_past_the_end_fails_with_enodata_after_the_started_copies_finished() {
        let file = temp_file(10_000);
        let fd = file.as_raw_fd();
        let mut dst = vec![0u8; 20_000];
        let at = dst.as_mut_ptr();
        let mut stager = Stager::new(Box::new(SlowCopier::new(4)), 0, 4096, 2).unwrap();
        let reads = [io(fd, 0, at, 0, 8192), io(fd, 8192, at, 8192, 4096)];
        let (code, message) = stager.run(XferOp::Read, &reads).unwrap_err();
        assert_eq!(code, libc::ENODATA, "{message}");
        // The stager is usable again (no ticket left behind).
        let ok = [io(fd, 0, at, 0, 8192)];
        stager.run(XferOp::Read, &ok).unwrap();
    }

    #[test]
    fn a_failed_copy_is_the_transfer_s_error() {
        let file = temp_file(1 << 16);
        let fd = file.as_raw_fd();
        let mut src = pattern(1 << 16, 1);
        let mut copier = SlowCopier::new(2);
        copier.fail_at = Some(3);
        let mut stager = Stager::new(Box::new(copier), 0, 4096, 2).unwrap();
        let (code, message) = stager
            .run(XferOp::Write, &[io(fd, 0, src.as_mut_ptr(), 0, 1 << 16)])
            .unwrap_err();
        assert_eq!(code, libc::EIO);
        assert!(message.contains("injected copy failure"), "{message}");
    }
}
