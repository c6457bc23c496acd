//! Descriptor lists as they cross from Python: a memory-kind code and a byte string of
//! little-endian `u64` triples `(addr, len, dev_id)` (what `array('Q').tobytes()` or
//! `numpy.ndarray.astype('<u8').tobytes()` gives), so a list of thousands of
//! descriptors crosses in one copy instead of one Python object per field.

use crate::errors::nixlInvalidParamError;
use nixl::{Desc, DescList, MemKind};
use pyo3::prelude::*;

const TRIPLE: usize = 3 * std::mem::size_of::<u64>();

/// The memory kind of a code from `nixl_mem_t` (`DRAM_SEG` = 0 … `OBJ_SEG` = 4).
pub fn kind(code: u8) -> PyResult<MemKind> {
    MemKind::from_code(code)
        .ok_or_else(|| nixlInvalidParamError::new_err(format!("unknown memory type code {code}")))
}

/// Decodes `packed` into a list of `kind`.
pub fn list(code: u8, packed: &[u8]) -> PyResult<DescList> {
    let kind = kind(code)?;
    if !packed.len().is_multiple_of(TRIPLE) {
        return Err(nixlInvalidParamError::new_err(format!(
            "descriptor buffer of {} bytes is not a whole number of (addr, len, dev_id) u64 triples",
            packed.len()
        )));
    }
    let word = |chunk: &[u8], i: usize| {
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(&chunk[i * 8..i * 8 + 8]);
        u64::from_le_bytes(bytes)
    };
    Ok(DescList::from_descs(
        kind,
        packed
            .chunks_exact(TRIPLE)
            .map(|c| Desc::new(word(c, 0), word(c, 1), word(c, 2))),
    ))
}

/// Indices for `make_prepped_xfer`: a byte string of little-endian `i64` (what the Python
/// layer makes of a list or a numpy array), each checked to be non-negative.
pub fn indices(packed: &[u8], which: &str) -> PyResult<Vec<usize>> {
    if !packed.len().is_multiple_of(8) {
        return Err(nixlInvalidParamError::new_err(format!(
            "{which} index buffer of {} bytes is not a whole number of i64",
            packed.len()
        )));
    }
    packed
        .chunks_exact(8)
        .enumerate()
        .map(|(pos, c)| {
            let mut bytes = [0u8; 8];
            bytes.copy_from_slice(c);
            let v = i64::from_le_bytes(bytes);
            usize::try_from(v).map_err(|_| {
                nixlInvalidParamError::new_err(format!(
                    "{which} index {v} (position {pos}) is negative"
                ))
            })
        })
        .collect()
}
