//! Address vectors (`fid_av`): peer addresses as compact `fi_addr_t` handles.

use crate::domain::{Domain, DomainInner};
use crate::error::{cvt, Error, Result};
use crate::{close_fid, ffi};
use std::ffi::c_char;
use std::ptr;
use std::sync::Arc;

/// A peer in an [`AddressVector`] (`fi_addr_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct Address(pub ffi::fi_addr_t);

impl Address {
    /// `FI_ADDR_UNSPEC`: any peer (receives) or the connected peer (MSG endpoints).
    pub const UNSPEC: Address = Address(ffi::FI_ADDR_UNSPEC);

    /// The address of receive context `index` of this (scalable) peer, in an address
    /// vector opened with `rx_ctx_bits` (`fi_rx_addr`).
    #[doc(alias = "fi_rx_addr")]
    pub fn rx_context(self, index: i32, rx_ctx_bits: i32) -> Address {
        // SAFETY: fi_rx_addr is pure arithmetic on its arguments.
        Address(unsafe { ffi::fi_rx_addr(self.0, index, rx_ctx_bits) })
    }
}

/// The address vector type (`enum fi_av_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AvType {
    /// `FI_AV_UNSPEC`: the provider's choice.
    Unspec,
    /// `FI_AV_MAP`: addresses are provider handles.
    Map,
    /// `FI_AV_TABLE`: addresses are indices 0, 1, 2, …
    Table,
}

pub(crate) struct AvInner {
    pub(crate) raw: *mut ffi::fid_av,
    _domain: Arc<DomainInner>,
}

// SAFETY: the AV belongs to an FI_THREAD_SAFE domain (checked in Domain::new).
unsafe impl Send for AvInner {}
// SAFETY: as above.
unsafe impl Sync for AvInner {}

impl Drop for AvInner {
    fn drop(&mut self) {
        // SAFETY: the fid of an open AV; endpoints bound to it hold an Arc and are closed.
        let _guard = self._domain.control_guard();
        close_fid("address vector", crate::fid_of(self.raw));
    }
}

/// An address vector (`fid_av`). Raw addresses (endpoint names, [`crate::Endpoint::name`])
/// are plain bytes that can be sent to another process and inserted there.
#[derive(Clone)]
pub struct AddressVector {
    pub(crate) inner: Arc<AvInner>,
}

impl std::fmt::Debug for AddressVector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AddressVector")
            .field("raw", &self.inner.raw)
            .finish()
    }
}

impl AddressVector {
    /// Opens an address vector for about `count` peers (`fi_av_open`).
    #[doc(alias = "fi_av_open")]
    pub fn new(domain: &Domain, ty: AvType, count: usize) -> Result<AddressVector> {
        Self::with_rx_ctx_bits(domain, ty, count, 0)
    }

    /// Like [`new`](Self::new), reserving the top `rx_ctx_bits` bits of each address for
    /// a receive-context index (scalable endpoints, [`Address::rx_context`]).
    pub fn with_rx_ctx_bits(
        domain: &Domain,
        ty: AvType,
        count: usize,
        rx_ctx_bits: i32,
    ) -> Result<AddressVector> {
        let mut attr = ffi::fi_av_attr {
            rx_ctx_bits,
            type_: match ty {
                AvType::Unspec => ffi::FI_AV_UNSPEC,
                AvType::Map => ffi::FI_AV_MAP,
                AvType::Table => ffi::FI_AV_TABLE,
            },
            count,
            ..Default::default()
        };
        let mut raw = ptr::null_mut();
        // SAFETY: domain is open; attr is valid; raw receives the new AV.
        let ret =
            unsafe { ffi::fi_av_open(domain.inner.raw, &mut attr, &mut raw, ptr::null_mut()) };
        cvt("fi_av_open", ret)?;
        Ok(AddressVector {
            inner: Arc::new(AvInner {
                raw,
                _domain: Arc::clone(&domain.inner),
            }),
        })
    }

    /// The raw `fid_av`.
    pub fn as_raw(&self) -> *mut ffi::fid_av {
        self.inner.raw
    }

    /// Wraps an open `fid_av` of `domain`.
    ///
    /// # Safety
    /// `raw` must be an open AV of `domain`, owned by nobody else (closed on drop).
    pub unsafe fn from_raw(domain: &Domain, raw: *mut ffi::fid_av) -> AddressVector {
        AddressVector {
            inner: Arc::new(AvInner {
                raw,
                _domain: Arc::clone(&domain.inner),
            }),
        }
    }

    /// Inserts one raw address (an endpoint name) and returns its handle (`fi_av_insert`).
    #[doc(alias = "fi_av_insert")]
    pub fn insert(&self, addr: &[u8]) -> Result<Address> {
        if addr.is_empty() {
            return Err(Error::InvalidArgument {
                call: "fi_av_insert",
                detail: "empty address".into(),
            });
        }
        let mut out = ffi::FI_ADDR_NOTAVAIL;
        // SAFETY: addr holds one address in the domain's format; out receives one handle.
        let ret = unsafe {
            ffi::fi_av_insert(
                self.inner.raw,
                addr.as_ptr().cast(),
                1,
                &mut out,
                0,
                ptr::null_mut(),
            )
        };
        if ret < 0 {
            return Err(Error::from_ret("fi_av_insert", ret as isize));
        }
        if ret != 1 || out == ffi::FI_ADDR_NOTAVAIL {
            return Err(Error::Call {
                call: "fi_av_insert",
                errno: ffi::FI_EINVAL,
                message: "address not inserted".into(),
                context: format!(": {} bytes", addr.len()),
            });
        }
        Ok(Address(out))
    }

    /// Inserts an address given as a string in `FI_ADDR_STR` form (`fi_av_insertsvc` is not
    /// used: the string is the provider's own, e.g. `fi_shm://…`).
    pub fn insert_str(&self, addr: &str) -> Result<Address> {
        let mut bytes = addr.as_bytes().to_vec();
        bytes.push(0);
        self.insert(&bytes)
    }

    /// Removes addresses (`fi_av_remove`).
    #[doc(alias = "fi_av_remove")]
    pub fn remove(&self, addrs: &[Address]) -> Result<()> {
        let mut raw: Vec<ffi::fi_addr_t> = addrs.iter().map(|a| a.0).collect();
        // SAFETY: raw holds addrs.len() handles of this AV.
        let ret = unsafe { ffi::fi_av_remove(self.inner.raw, raw.as_mut_ptr(), raw.len(), 0) };
        cvt("fi_av_remove", ret)
    }

    /// The raw address behind a handle (`fi_av_lookup`).
    #[doc(alias = "fi_av_lookup")]
    pub fn lookup(&self, addr: Address) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; 256];
        loop {
            let mut len = buf.len();
            // SAFETY: buf has len writable bytes; len receives the address length.
            let ret = unsafe {
                ffi::fi_av_lookup(self.inner.raw, addr.0, buf.as_mut_ptr().cast(), &mut len)
            };
            cvt("fi_av_lookup", ret)?;
            if len <= buf.len() {
                buf.truncate(len);
                return Ok(buf);
            }
            buf.resize(len, 0);
        }
    }

    /// A printable form of a raw address (`fi_av_straddr`).
    #[doc(alias = "fi_av_straddr")]
    pub fn straddr(&self, addr: &[u8]) -> String {
        let mut buf = [0 as c_char; 256];
        let mut len = buf.len();
        // SAFETY: buf has len writable bytes; addr is a raw address of this AV's format.
        let p = unsafe {
            ffi::fi_av_straddr(
                self.inner.raw,
                addr.as_ptr().cast(),
                buf.as_mut_ptr(),
                &mut len,
            )
        };
        if p.is_null() {
            return String::new();
        }
        // SAFETY: fi_av_straddr NUL-terminates within buf.
        unsafe { std::ffi::CStr::from_ptr(p) }
            .to_string_lossy()
            .into_owned()
    }
}
