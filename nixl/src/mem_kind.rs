//! [`MemKind`], in a leaf module: the error type names it (which memory a descriptor was
//! of) and the memory model returns that error, so neither `error` nor `mem` imports
//! the other. Re-exported as `nixl::mem::MemKind` and `nixl::MemKind`.

/// Where a descriptor's bytes live. Same set as NIXL's `nixl_mem_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum MemKind {
    /// Host memory (`DRAM_SEG`).
    Dram = 0,
    /// GPU memory (`VRAM_SEG`); `dev_id` is the CUDA device ordinal.
    Vram = 1,
    /// A file (`FILE_SEG`); `dev_id` is the file descriptor, `addr` the file offset.
    File = 2,
    /// A block device (`BLK_SEG`).
    Block = 3,
    /// An object store key (`OBJ_SEG`); `dev_id` names the object.
    Object = 4,
}

impl MemKind {
    /// All kinds, in wire order.
    pub const ALL: [MemKind; 5] = [
        Self::Dram,
        Self::Vram,
        Self::File,
        Self::Block,
        Self::Object,
    ];

    /// The wire code used in metadata.
    pub fn code(self) -> u8 {
        self as u8
    }

    /// Inverse of [`MemKind::code`]; `None` for codes this version does not know.
    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.get(usize::from(code)).copied()
    }

    /// Parses NIXL's names (`DRAM`, `VRAM`, `FILE`, `BLK`, `OBJ`, case-insensitive).
    pub fn parse(name: &str) -> Option<Self> {
        match name.to_ascii_uppercase().as_str() {
            "DRAM" | "DRAM_SEG" => Some(Self::Dram),
            "VRAM" | "VRAM_SEG" => Some(Self::Vram),
            "FILE" | "FILE_SEG" => Some(Self::File),
            "BLK" | "BLOCK" | "BLK_SEG" => Some(Self::Block),
            "OBJ" | "OBJECT" | "OBJ_SEG" => Some(Self::Object),
            _ => None,
        }
    }
}
