//! Event queues (`fid_eq`): connection-management events of MSG endpoints.

use crate::domain::{Fabric, FabricInner};
use crate::error::{cvt, is_disconnect_errno, strerror, Error, Result};
use crate::info::Info;
use crate::{close_fid, ffi};
use std::ffi::CStr;
use std::mem::size_of;
use std::ptr;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(crate) struct EqInner {
    pub(crate) raw: *mut ffi::fid_eq,
    _fabric: Arc<FabricInner>,
}

// SAFETY: EQs are thread-safe objects of a fabric whose domains are FI_THREAD_SAFE.
unsafe impl Send for EqInner {}
// SAFETY: as above.
unsafe impl Sync for EqInner {}

impl Drop for EqInner {
    fn drop(&mut self) {
        // SAFETY: the fid of an open EQ; bound endpoints hold an Arc and are closed.
        close_fid("event queue", crate::fid_of(self.raw));
    }
}

/// An event: `event` is `ffi::FI_CONNREQ`, `ffi::FI_CONNECTED`, `ffi::FI_SHUTDOWN`, … (a
/// plain value: unknown events are passed through).
#[derive(Debug)]
pub struct CmEvent {
    /// The event number.
    pub event: u32,
    /// The fid the event is about (an endpoint or passive endpoint), as an address.
    pub fid: usize,
    /// For `FI_CONNREQ`: the info to open the accepting endpoint with.
    pub info: Option<Info>,
    /// Connection data sent by the peer, if any.
    pub data: Vec<u8>,
}

/// An event queue (`fid_eq`).
#[derive(Clone)]
pub struct EventQueue {
    pub(crate) inner: Arc<EqInner>,
}

impl std::fmt::Debug for EventQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventQueue")
            .field("raw", &self.inner.raw)
            .finish()
    }
}

const EQ_BUF: usize = size_of::<ffi::fi_eq_cm_entry>() + 512;

impl EventQueue {
    /// Opens an event queue with a wait object, so [`sread`](Self::sread) blocks
    /// (`fi_eq_open`).
    #[doc(alias = "fi_eq_open")]
    pub fn new(fabric: &Fabric) -> Result<EventQueue> {
        let mut attr = ffi::fi_eq_attr {
            size: 64,
            wait_obj: ffi::FI_WAIT_UNSPEC,
            ..Default::default()
        };
        let mut raw = ptr::null_mut();
        // SAFETY: fabric is open; attr is valid; raw receives the EQ.
        let ret = unsafe {
            ffi::fi_eq_open(fabric.inner.raw_ptr(), &mut attr, &mut raw, ptr::null_mut())
        };
        cvt("fi_eq_open", ret)?;
        Ok(EventQueue {
            inner: Arc::new(EqInner {
                raw,
                _fabric: Arc::clone(&fabric.inner),
            }),
        })
    }

    /// The raw `fid_eq`.
    pub fn as_raw(&self) -> *mut ffi::fid_eq {
        self.inner.raw
    }

    /// Wraps an open `fid_eq` of `fabric`.
    ///
    /// # Safety
    /// `raw` must be an open EQ of `fabric`, owned by nobody else (closed on drop).
    pub unsafe fn from_raw(fabric: &Fabric, raw: *mut ffi::fid_eq) -> EventQueue {
        EventQueue {
            inner: Arc::new(EqInner {
                raw,
                _fabric: Arc::clone(&fabric.inner),
            }),
        }
    }

    fn decode(&self, event: u32, buf: &[u64], len: usize) -> CmEvent {
        let base = buf.as_ptr().cast::<u8>();
        let mut out = CmEvent {
            event,
            fid: 0,
            info: None,
            data: Vec::new(),
        };
        if len >= size_of::<ffi::fid_t>() {
            // SAFETY: every EQ entry starts with the fid.
            out.fid = unsafe { base.cast::<ffi::fid_t>().read_unaligned() } as usize;
        }
        if matches!(
            event,
            ffi::FI_CONNREQ | ffi::FI_CONNECTED | ffi::FI_SHUTDOWN
        ) && len >= size_of::<ffi::fi_eq_cm_entry>()
        {
            // SAFETY: CM events are fi_eq_cm_entry followed by `len - header` data bytes.
            let entry = unsafe { base.cast::<ffi::fi_eq_cm_entry>().read_unaligned() };
            if !entry.info.is_null() {
                // SAFETY: the application owns the info of a CM event and frees it.
                out.info = Some(unsafe { Info::from_raw(entry.info) });
            }
            let header = size_of::<ffi::fi_eq_cm_entry>();
            // SAFETY: the provider wrote len bytes.
            out.data =
                unsafe { std::slice::from_raw_parts(base.add(header), len - header) }.to_vec();
        }
        out
    }

    fn convert(
        &self,
        ret: isize,
        event: u32,
        buf: &[u64],
        call: &'static str,
    ) -> Result<Option<CmEvent>> {
        if ret == -(ffi::FI_EAGAIN as isize) {
            return Ok(None);
        }
        if ret == -(ffi::FI_EAVAIL as isize) {
            return Err(self.read_error());
        }
        if ret < 0 {
            return Err(Error::from_ret(call, ret));
        }
        Ok(Some(self.decode(event, buf, ret as usize)))
    }

    /// Reads one event without blocking (`fi_eq_read`); `Ok(None)` when there is none.
    #[doc(alias = "fi_eq_read")]
    pub fn read(&self) -> Result<Option<CmEvent>> {
        let mut buf = [0u64; EQ_BUF / 8];
        let mut event = 0u32;
        // SAFETY: buf has EQ_BUF writable bytes.
        let ret = unsafe {
            ffi::fi_eq_read(
                self.inner.raw,
                &mut event,
                buf.as_mut_ptr().cast(),
                EQ_BUF,
                0,
            )
        };
        self.convert(ret, event, &buf, "fi_eq_read")
    }

    /// Blocks up to `timeout` for one event (`fi_eq_sread`); [`Error::TimedOut`] if none.
    #[doc(alias = "fi_eq_sread")]
    pub fn sread(&self, timeout: Duration) -> Result<CmEvent> {
        let deadline = Instant::now() + timeout;
        loop {
            let mut buf = [0u64; EQ_BUF / 8];
            let mut event = 0u32;
            let left = deadline.saturating_duration_since(Instant::now());
            let ms = left.as_millis().clamp(1, 100) as i32;
            // SAFETY: buf has EQ_BUF writable bytes.
            let ret = unsafe {
                ffi::fi_eq_sread(
                    self.inner.raw,
                    &mut event,
                    buf.as_mut_ptr().cast(),
                    EQ_BUF,
                    ms,
                    0,
                )
            };
            if ret != -(ffi::FI_ETIMEDOUT as isize) {
                if let Some(ev) = self.convert(ret, event, &buf, "fi_eq_sread")? {
                    return Ok(ev);
                }
            }
            if Instant::now() >= deadline {
                return Err(Error::TimedOut {
                    call: "fi_eq_sread",
                    after: timeout,
                });
            }
        }
    }

    /// Waits for event `expected`; `FI_SHUTDOWN` instead is [`Error::RemoteDisconnect`],
    /// anything else [`Error::UnexpectedEvent`].
    pub fn wait_event(
        &self,
        expected: u32,
        name: &'static str,
        timeout: Duration,
    ) -> Result<CmEvent> {
        let ev = self.sread(timeout)?;
        if ev.event == expected {
            Ok(ev)
        } else if ev.event == ffi::FI_SHUTDOWN {
            Err(Error::RemoteDisconnect {
                call: "fi_eq_sread",
                errno: ffi::FI_ESHUTDOWN,
                detail: format!("FI_SHUTDOWN while waiting for {name}"),
                completion: None,
            })
        } else {
            Err(Error::UnexpectedEvent {
                call: "fi_eq_sread",
                expected: name,
                got: ev.event,
            })
        }
    }

    /// `fi_eq_readerr` as a typed error.
    #[doc(alias = "fi_eq_readerr")]
    pub fn read_error(&self) -> Error {
        let mut entry = ffi::fi_eq_err_entry::default();
        // SAFETY: entry is a zeroed fi_eq_err_entry.
        let ret = unsafe { ffi::fi_eq_readerr(self.inner.raw, &mut entry, 0) };
        if ret < 0 {
            return Error::from_ret("fi_eq_readerr", ret);
        }
        let mut text = [0 as std::ffi::c_char; 256];
        // SAFETY: text is writable for its length; err_data belongs to the entry.
        let prov_message = unsafe {
            let p = ffi::fi_eq_strerror(
                self.inner.raw,
                entry.prov_errno,
                entry.err_data,
                text.as_mut_ptr(),
                text.len(),
            );
            if p.is_null() {
                String::new()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        };
        if is_disconnect_errno(entry.err) {
            return Error::RemoteDisconnect {
                call: "fi_eq_readerr",
                errno: entry.err,
                detail: format!("{} ({prov_message})", strerror(entry.err)),
                completion: None,
            };
        }
        Error::Event {
            errno: entry.err,
            prov_errno: entry.prov_errno,
            message: strerror(entry.err),
            prov_message,
        }
    }
}
