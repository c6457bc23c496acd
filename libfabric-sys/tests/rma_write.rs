//! Raw-FFI end-to-end tests on the host: `fi_getinfo` for `tcp;ofi_rxm`, and for each of
//! `tcp;ofi_rxm`, `sockets` and `shm` two RDM endpoints in one process, an AV, 1 MiB
//! registered on each side (honouring the `mr_mode` bits the provider returns), an
//! `fi_write` of 1 MiB and the bytes verified at the target.
//!
//! Every wait is bounded; a watchdog aborts the test binary if anything blocks in C.

use core::ffi::{c_char, c_int, c_void, CStr};
use libfabric_sys as ffi;
use std::ffi::CString;
use std::ptr;
use std::sync::Once;
use std::time::{Duration, Instant};

const LEN: usize = 1 << 20;
const OP_TIMEOUT: Duration = Duration::from_secs(20);

fn watchdog() {
    static START: Once = Once::new();
    START.call_once(|| {
        std::thread::spawn(|| {
            std::thread::sleep(Duration::from_secs(120));
            eprintln!("libfabric-sys tests: watchdog expired after 120 s, aborting");
            std::process::abort();
        });
    });
}

fn check(ret: c_int, what: &str) {
    if ret != 0 {
        panic!("{what} failed: {ret} ({})", strerror(-ret));
    }
}

fn strerror(errnum: c_int) -> String {
    // SAFETY: fi_strerror returns a pointer to a static NUL-terminated string.
    unsafe { CStr::from_ptr(ffi::fi_strerror(errnum)) }
        .to_string_lossy()
        .into_owned()
}

/// `fi_getinfo` for RDM endpoints with RMA on `prov`, on loopback. The caller frees the
/// result with `fi_freeinfo`.
fn getinfo(prov: &str) -> *mut ffi::fi_info {
    // SAFETY: raw FFI on objects this function owns; hints is freed before returning.
    unsafe {
        let hints = ffi::fi_allocinfo();
        assert!(!hints.is_null(), "fi_allocinfo returned NULL");
        (*hints).caps = ffi::FI_MSG | ffi::FI_RMA | ffi::FI_READ | ffi::FI_WRITE;
        (*hints).caps |= ffi::FI_REMOTE_READ | ffi::FI_REMOTE_WRITE;
        (*hints).mode = ffi::FI_CONTEXT | ffi::FI_CONTEXT2;
        (*(*hints).ep_attr).type_ = ffi::FI_EP_RDM;
        // The initiator's completion then means the data is placed at the target.
        (*(*hints).tx_attr).op_flags = ffi::FI_DELIVERY_COMPLETE;
        // Every mr_mode bit this test knows how to honour.
        (*(*hints).domain_attr).mr_mode = ffi::FI_MR_LOCAL
            | ffi::FI_MR_VIRT_ADDR
            | ffi::FI_MR_ALLOCATED
            | ffi::FI_MR_PROV_KEY
            | ffi::FI_MR_ENDPOINT;
        let name = CString::new(prov).expect("provider name");
        // fi_freeinfo frees prov_name: it must come from malloc.
        (*(*hints).fabric_attr).prov_name = libc::strdup(name.as_ptr());
        let (node, flags) = if prov == "shm" {
            (None, 0)
        } else {
            (
                Some(CString::new("127.0.0.1").expect("node")),
                ffi::FI_SOURCE,
            )
        };
        let mut info = ptr::null_mut();
        let ret = ffi::fi_getinfo(
            ffi::FI_VERSION(1, 17),
            node.as_ref().map_or(ptr::null(), |n| n.as_ptr()),
            ptr::null(),
            flags,
            hints,
            &mut info,
        );
        ffi::fi_freeinfo(hints);
        check(ret, &format!("fi_getinfo({prov})"));
        assert!(!info.is_null());
        info
    }
}

fn prov_name(info: *const ffi::fi_info) -> String {
    // SAFETY: info comes from fi_getinfo; fabric_attr and prov_name are set by it.
    unsafe { CStr::from_ptr((*(*info).fabric_attr).prov_name as *const c_char) }
        .to_string_lossy()
        .into_owned()
}

#[test]
fn getinfo_tcp_rxm() {
    watchdog();
    let info = getinfo("tcp;ofi_rxm");
    // SAFETY: info is a valid list from fi_getinfo, freed once at the end.
    unsafe {
        let mut count = 0;
        let mut cur = info;
        while !cur.is_null() {
            assert_eq!(prov_name(cur), "tcp;ofi_rxm");
            assert_eq!((*(*cur).ep_attr).type_, ffi::FI_EP_RDM);
            assert_ne!((*cur).caps & ffi::FI_RMA, 0, "RMA was asked for");
            assert!((*(*cur).ep_attr).max_msg_size >= LEN);
            count += 1;
            cur = (*cur).next;
        }
        assert!(count >= 1);
        ffi::fi_freeinfo(info);
    }
}

/// One endpoint with its CQ and its registered 1 MiB.
struct Side {
    ep: *mut ffi::fid_ep,
    cq: *mut ffi::fid_cq,
    mr: *mut ffi::fid_mr,
    buf: Vec<u8>,
    addr: ffi::fi_addr_t,
}

fn fid_of_ep(ep: *mut ffi::fid_ep) -> *mut ffi::fid {
    // SAFETY: the first member of fid_ep is its fid.
    unsafe { ptr::addr_of_mut!((*ep).fid) }
}

/// Read one completion from `cq`; `Ok(None)` when it is empty.
fn cq_read(cq: *mut ffi::fid_cq) -> Result<Option<ffi::fi_cq_data_entry>, String> {
    let mut entry = ffi::fi_cq_data_entry::default();
    // SAFETY: cq is open and entry is a fi_cq_data_entry, the format the CQ was opened with.
    let ret = unsafe { ffi::fi_cq_read(cq, ptr::addr_of_mut!(entry).cast(), 1) };
    if ret == 1 {
        return Ok(Some(entry));
    }
    if ret == -(ffi::FI_EAGAIN as isize) {
        return Ok(None);
    }
    if ret == -(ffi::FI_EAVAIL as isize) {
        let mut err = ffi::fi_cq_err_entry::default();
        // SAFETY: cq is open; err is a valid fi_cq_err_entry.
        let r = unsafe { ffi::fi_cq_readerr(cq, &mut err, 0) };
        return Err(format!(
            "completion error (readerr {r}): {} ({}), prov_errno {}",
            err.err,
            strerror(err.err),
            err.prov_errno
        ));
    }
    Err(format!("fi_cq_read: {ret} ({})", strerror(-ret as c_int)))
}

fn write_1mib(prov: &str) {
    watchdog();
    let info = getinfo(prov);
    assert_eq!(prov_name(info), prov);
    // SAFETY: raw FFI; every object is closed below in reverse order of creation, and
    // the buffers outlive their registrations and the operation.
    unsafe {
        let mr_mode = (*(*info).domain_attr).mr_mode;
        let max_msg = (*(*info).ep_attr).max_msg_size;
        let mut fabric = ptr::null_mut();
        check(
            ffi::fi_fabric((*info).fabric_attr, &mut fabric, ptr::null_mut()),
            "fi_fabric",
        );
        let mut domain = ptr::null_mut();
        check(
            ffi::fi_domain(fabric, info, &mut domain, ptr::null_mut()),
            "fi_domain",
        );
        let mut av_attr = ffi::fi_av_attr {
            type_: ffi::FI_AV_TABLE,
            count: 4,
            ..Default::default()
        };
        let mut av = ptr::null_mut();
        check(
            ffi::fi_av_open(domain, &mut av_attr, &mut av, ptr::null_mut()),
            "fi_av_open",
        );

        let mut sides = Vec::new();
        for (i, fill) in [(0u64, 0xa5u8), (1, 0u8)] {
            let mut cq_attr = ffi::fi_cq_attr {
                format: ffi::FI_CQ_FORMAT_DATA,
                size: 64,
                wait_obj: ffi::FI_WAIT_NONE,
                ..Default::default()
            };
            let mut cq = ptr::null_mut();
            check(
                ffi::fi_cq_open(domain, &mut cq_attr, &mut cq, ptr::null_mut()),
                "fi_cq_open",
            );
            let mut ep = ptr::null_mut();
            check(
                ffi::fi_endpoint(domain, info, &mut ep, ptr::null_mut()),
                "fi_endpoint",
            );
            check(
                ffi::fi_ep_bind(
                    ep,
                    ptr::addr_of_mut!((*cq).fid),
                    ffi::FI_TRANSMIT | ffi::FI_RECV,
                ),
                "fi_ep_bind(cq)",
            );
            check(
                ffi::fi_ep_bind(ep, ptr::addr_of_mut!((*av).fid), 0),
                "fi_ep_bind(av)",
            );
            check(ffi::fi_enable(ep), "fi_enable");

            let buf: Vec<u8> = if fill == 0 {
                vec![0; LEN]
            } else {
                (0..LEN)
                    .map(|j| (j as u8) ^ fill ^ ((j >> 8) as u8))
                    .collect()
            };
            let access = if i == 0 {
                ffi::FI_WRITE | ffi::FI_READ
            } else {
                ffi::FI_REMOTE_WRITE | ffi::FI_REMOTE_READ
            };
            let mut mr = ptr::null_mut();
            // Without FI_MR_PROV_KEY the application picks unique keys.
            check(
                ffi::fi_mr_reg(
                    domain,
                    buf.as_ptr().cast(),
                    LEN,
                    access,
                    0,
                    0x1000 + i,
                    0,
                    &mut mr,
                    ptr::null_mut(),
                ),
                "fi_mr_reg",
            );
            if mr_mode & ffi::FI_MR_ENDPOINT != 0 {
                check(ffi::fi_mr_bind(mr, fid_of_ep(ep), 0), "fi_mr_bind");
                check(ffi::fi_mr_enable(mr), "fi_mr_enable");
            }

            let mut name = [0u8; 256];
            let mut name_len = name.len();
            check(
                ffi::fi_getname(fid_of_ep(ep), name.as_mut_ptr().cast(), &mut name_len),
                "fi_getname",
            );
            let mut addr = ffi::FI_ADDR_UNSPEC;
            let inserted =
                ffi::fi_av_insert(av, name.as_ptr().cast(), 1, &mut addr, 0, ptr::null_mut());
            assert_eq!(inserted, 1, "fi_av_insert");
            assert_ne!(addr, ffi::FI_ADDR_NOTAVAIL);
            sides.push(Side {
                ep,
                cq,
                mr,
                buf,
                addr,
            });
        }

        let (init, target) = (&sides[0], &sides[1]);
        let desc = if mr_mode & ffi::FI_MR_LOCAL != 0 {
            ffi::fi_mr_desc(init.mr)
        } else {
            ptr::null_mut()
        };
        let key = ffi::fi_mr_key(target.mr);
        assert_ne!(key, ffi::FI_KEY_NOTAVAIL);
        let base = if mr_mode & ffi::FI_MR_VIRT_ADDR != 0 {
            target.buf.as_ptr() as u64
        } else {
            0
        };

        let chunk = max_msg.min(LEN);
        let mut contexts: Vec<ffi::fi_context2> =
            vec![ffi::fi_context2::default(); LEN.div_ceil(chunk)];
        let mut posted = 0;
        let mut offset = 0;
        let deadline = Instant::now() + OP_TIMEOUT;
        while offset < LEN {
            let len = chunk.min(LEN - offset);
            let ret = ffi::fi_write(
                init.ep,
                init.buf.as_ptr().add(offset).cast(),
                len,
                desc,
                target.addr,
                base + offset as u64,
                key,
                ptr::addr_of_mut!(contexts[posted]).cast::<c_void>(),
            );
            if ret == -(ffi::FI_EAGAIN as isize) {
                // Progress both sides, then retry.
                for side in &sides {
                    if let Some(entry) = cq_read(side.cq).unwrap_or_else(|e| panic!("{prov}: {e}"))
                    {
                        panic!(
                            "{prov}: unexpected completion {entry:?} before any write completed"
                        );
                    }
                }
                assert!(
                    Instant::now() < deadline,
                    "{prov}: fi_write kept returning EAGAIN"
                );
                continue;
            }
            assert_eq!(ret, 0, "{prov}: fi_write: {}", strerror(-ret as c_int));
            posted += 1;
            offset += len;
        }

        let mut completed = 0;
        while completed < posted {
            // The target must be progressed too (manual progress providers).
            if let Some(entry) =
                cq_read(target.cq).unwrap_or_else(|e| panic!("{prov}: target: {e}"))
            {
                panic!("{prov}: unexpected target completion {entry:?}");
            }
            if let Some(entry) = cq_read(init.cq).unwrap_or_else(|e| panic!("{prov}: {e}")) {
                assert_ne!(entry.flags & ffi::FI_WRITE, 0, "{prov}: {entry:?}");
                assert_ne!(entry.flags & ffi::FI_RMA, 0, "{prov}: {entry:?}");
                let ctx = entry.op_context as *const ffi::fi_context2;
                assert!(
                    contexts.as_ptr_range().contains(&ctx),
                    "{prov}: foreign context"
                );
                completed += 1;
            }
            assert!(
                Instant::now() < deadline,
                "{prov}: no write completion within {OP_TIMEOUT:?}"
            );
        }
        // FI_DELIVERY_COMPLETE: the bytes are in place once the initiator's completion
        // is reported. Read them volatile: the provider wrote them behind Rust's back.
        let received: Vec<u8> = (0..LEN)
            .map(|j| ptr::read_volatile(target.buf.as_ptr().add(j)))
            .collect();
        assert!(received == init.buf, "{prov}: bytes differ at the target");

        for side in sides.iter().rev() {
            check(ffi::fi_close(fid_of_ep(side.ep)), "fi_close(ep)");
            check(
                ffi::fi_close(ptr::addr_of_mut!((*side.mr).fid)),
                "fi_close(mr)",
            );
            check(
                ffi::fi_close(ptr::addr_of_mut!((*side.cq).fid)),
                "fi_close(cq)",
            );
        }
        check(ffi::fi_close(ptr::addr_of_mut!((*av).fid)), "fi_close(av)");
        check(
            ffi::fi_close(ptr::addr_of_mut!((*domain).fid)),
            "fi_close(domain)",
        );
        check(
            ffi::fi_close(ptr::addr_of_mut!((*fabric).fid)),
            "fi_close(fabric)",
        );
        ffi::fi_freeinfo(info);
    }
}

#[test]
fn write_1mib_tcp_rxm() {
    write_1mib("tcp;ofi_rxm");
}

#[test]
fn write_1mib_sockets() {
    write_1mib("sockets");
}

#[test]
fn write_1mib_shm() {
    write_1mib("shm");
}
