//! Atomic datatypes and operations (`enum fi_datatype`, `enum fi_op`).

use crate::ffi;

/// An atomic datatype (`enum fi_datatype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct AtomicDatatype(pub ffi::fi_datatype);

impl AtomicDatatype {
    /// `FI_INT8`.
    pub const I8: Self = Self(ffi::FI_INT8);
    /// `FI_UINT8`.
    pub const U8: Self = Self(ffi::FI_UINT8);
    /// `FI_INT32`.
    pub const I32: Self = Self(ffi::FI_INT32);
    /// `FI_UINT32`.
    pub const U32: Self = Self(ffi::FI_UINT32);
    /// `FI_INT64`.
    pub const I64: Self = Self(ffi::FI_INT64);
    /// `FI_UINT64`.
    pub const U64: Self = Self(ffi::FI_UINT64);
    /// `FI_FLOAT`.
    pub const F32: Self = Self(ffi::FI_FLOAT);
    /// `FI_DOUBLE`.
    pub const F64: Self = Self(ffi::FI_DOUBLE);
}

/// An atomic operation (`enum fi_op`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct AtomicOp(pub ffi::fi_op);

impl AtomicOp {
    /// `FI_MIN`.
    pub const MIN: Self = Self(ffi::FI_MIN);
    /// `FI_MAX`.
    pub const MAX: Self = Self(ffi::FI_MAX);
    /// `FI_SUM`.
    pub const SUM: Self = Self(ffi::FI_SUM);
    /// `FI_PROD`.
    pub const PROD: Self = Self(ffi::FI_PROD);
    /// `FI_BOR`.
    pub const BOR: Self = Self(ffi::FI_BOR);
    /// `FI_BAND`.
    pub const BAND: Self = Self(ffi::FI_BAND);
    /// `FI_BXOR`.
    pub const BXOR: Self = Self(ffi::FI_BXOR);
    /// `FI_ATOMIC_READ`.
    pub const READ: Self = Self(ffi::FI_ATOMIC_READ);
    /// `FI_ATOMIC_WRITE`.
    pub const WRITE: Self = Self(ffi::FI_ATOMIC_WRITE);
    /// `FI_CSWAP`: compare and swap.
    pub const CSWAP: Self = Self(ffi::FI_CSWAP);
}
