//! Descriptor lists as they cross from Python: a memory-kind code and a byte string of
//! little-endian `u64` triples `(addr, len, dev_id)` (what `array('Q').tobytes()` or
//! `numpy.ndarray.astype('<u8').tobytes()` gives), so a list of thousands of
//! descriptors crosses in one copy instead of one Python object per field.
//! [`pack_descs`] and [`pack_indices`] build those byte strings from Python lists of
//! tuples and of ints in one pass at C speed.

use crate::errors::nixlInvalidParamError;
use nixl::{Desc, DescList, MemKind};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

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

/// A list or a tuple (subclasses included, as `isinstance` takes them), read by
/// position through borrowed references at C speed.
struct Items<'a, 'py> {
    seq: &'a Bound<'py, PyAny>,
    len: usize,
    get: unsafe extern "C" fn(*mut ffi::PyObject, ffi::Py_ssize_t) -> *mut ffi::PyObject,
}

impl<'a, 'py> Items<'a, 'py> {
    fn of(seq: &'a Bound<'py, PyAny>) -> Option<Self> {
        if let Ok(list) = seq.cast::<PyList>() {
            Some(Self {
                seq,
                len: list.len(),
                get: ffi::PyList_GetItem,
            })
        } else if let Ok(tuple) = seq.cast::<PyTuple>() {
            Some(Self {
                seq,
                len: tuple.len(),
                get: ffi::PyTuple_GetItem,
            })
        } else {
            None
        }
    }

    /// A borrowed pointer to item `i`, or `None` (the error cleared) past the end.
    ///
    /// # Safety
    /// No Python code may run between this call and the last use of the pointer: code
    /// that shrinks the sequence would free the item. (The GIL is held: `seq` is bound.)
    unsafe fn item(&self, i: usize) -> Option<*mut ffi::PyObject> {
        let index = ffi::Py_ssize_t::try_from(i).ok()?;
        // SAFETY: `seq` is a live list or tuple (checked in `of`), matching `get`.
        let item = unsafe { (self.get)(self.seq.as_ptr(), index) };
        if item.is_null() {
            // SAFETY: the GIL is held; this clears the IndexError just raised.
            unsafe { ffi::PyErr_Clear() };
            return None;
        }
        Some(item)
    }
}

/// The value of an `int` (subclasses included) through `as_int` (`PyLong_AsLongLong`,
/// `PyLong_AsUnsignedLongLong`), or `None` (the error cleared) for any other object or a
/// value out of range (`as_int` returned `error_value` with an error set). Runs no
/// Python code: objects that are not ints are refused rather than asked for `__index__`.
///
/// # Safety
/// `obj` is a live object and the GIL is held.
unsafe fn int_value<T: Copy + PartialEq>(
    obj: *mut ffi::PyObject,
    as_int: unsafe extern "C" fn(*mut ffi::PyObject) -> T,
    error_value: T,
) -> Option<T> {
    // SAFETY: the caller's contract: `obj` is live and the GIL is held.
    unsafe {
        if ffi::PyLong_Check(obj) == 0 {
            return None;
        }
        let value = as_int(obj);
        if value == error_value && !ffi::PyErr_Occurred().is_null() {
            ffi::PyErr_Clear();
            return None;
        }
        Some(value)
    }
}

/// The first three fields of each tuple in `descs` (a list or tuple of tuples of exactly
/// `width` elements) as native-endian `u64` triples `(addr, len, dev_id)`: what
/// `array('Q').frombytes` takes, built at C speed without a Python object per field.
///
/// `None` where any entry is not a `tuple` of `width` elements whose first three fields
/// are ints in `0..2**64`: the caller then takes its checked path, which converts other
/// integer types (`__index__`) and raises the precise error for bad entries.
#[pyfunction]
pub fn pack_descs<'py>(
    py: Python<'py>,
    descs: &Bound<'py, PyAny>,
    width: usize,
) -> PyResult<Option<Bound<'py, PyBytes>>> {
    if width < 3 {
        return Err(nixlInvalidParamError::new_err(format!(
            "a descriptor has at least 3 fields (addr, len, dev_id), not {width}"
        )));
    }
    let Some(items) = Items::of(descs) else {
        return Ok(None);
    };
    let Some(size) = items.len.checked_mul(TRIPLE) else {
        return Ok(None);
    };
    let mut complete = true;
    // The buffer is allocated before the first item is read; from then on nothing runs
    // Python code (no allocation, no `__index__`) until the loop stops, so the borrowed
    // items stay valid. After a failed conversion (which allocates its exception) the
    // loop stops without touching another item.
    let packed = PyBytes::new_with(py, size, |buf| {
        for (i, chunk) in buf.chunks_exact_mut(TRIPLE).enumerate() {
            // SAFETY: the GIL is held and no Python code runs while `desc` and its
            // fields are used (above); PyTuple_GetItem on an exact tuple of `width`
            // elements returns borrowed, live items for indices below `width`.
            let words = unsafe {
                items.item(i).and_then(|desc| {
                    if ffi::PyTuple_CheckExact(desc) == 0
                        || usize::try_from(ffi::PyTuple_Size(desc)).ok() != Some(width)
                    {
                        return None;
                    }
                    let field = |f: ffi::Py_ssize_t| {
                        let obj = ffi::PyTuple_GetItem(desc, f);
                        int_value(obj, ffi::PyLong_AsUnsignedLongLong, u64::MAX)
                    };
                    Some([field(0)?, field(1)?, field(2)?])
                })
            };
            let Some(words) = words else {
                complete = false;
                return Ok(());
            };
            for (dst, word) in chunk.chunks_exact_mut(8).zip(words) {
                dst.copy_from_slice(&word.to_ne_bytes());
            }
        }
        Ok(())
    })?;
    Ok(complete.then_some(packed))
}

/// A list or tuple of ints as little-endian `i64` bytes (what [`indices`] decodes), at
/// C speed. `None` where an entry is not an int that fits an `i64`: the caller then
/// takes its checked path (which converts other integer types and raises the precise
/// error). Negative values pass here and are refused by [`indices`] with their position.
#[pyfunction]
pub fn pack_indices<'py>(
    py: Python<'py>,
    indices: &Bound<'py, PyAny>,
) -> PyResult<Option<Bound<'py, PyBytes>>> {
    let Some(items) = Items::of(indices) else {
        return Ok(None);
    };
    let Some(size) = items.len.checked_mul(8) else {
        return Ok(None);
    };
    let mut complete = true;
    // As in `pack_descs`: no Python code runs while borrowed items are read.
    let packed = PyBytes::new_with(py, size, |buf| {
        for (i, dst) in buf.chunks_exact_mut(8).enumerate() {
            // SAFETY: the GIL is held and no Python code runs while the item is used.
            let value = unsafe {
                items
                    .item(i)
                    .and_then(|obj| int_value(obj, ffi::PyLong_AsLongLong, -1))
            };
            let Some(value) = value else {
                complete = false;
                return Ok(());
            };
            dst.copy_from_slice(&value.to_le_bytes());
        }
        Ok(())
    })?;
    Ok(complete.then_some(packed))
}
