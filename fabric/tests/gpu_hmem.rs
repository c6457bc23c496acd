//! FI_HMEM_CUDA: CUDA device memory registered on `shm` (`fi_mr_regattr` with
//! `FI_HMEM_CUDA`) and written to a host buffer of a peer endpoint, verified on the host.
//!
//! Without libcuda or a GPU it skips with a printed reason — unless `NIXL_REQUIRE_GPU=1`
//! (the GPU bundle's run; `FABRIC_REQUIRE_GPU=1` too), where a missing GPU fails.
//! If the provider refuses device memory, the test asserts the refusal is typed
//! (`Error::Unsupported`, or the provider's errno) and reports it.
mod common;

use common::*;
use fabric::{Access, Caps, Error, HmemIface, MemoryRegion, MrMode};
use gpu_mem::cudarc;
use gpu_mem::cudarc::driver::{CudaContext, DevicePtr};
use std::time::Instant;

fn gpu_required() -> bool {
    ["NIXL_REQUIRE_GPU", "FABRIC_REQUIRE_GPU"]
        .iter()
        .any(|var| std::env::var(var).is_ok_and(|v| v == "1"))
}

/// The CUDA context of device 0, or `None` (with the reason printed) when there is none.
fn cuda() -> Option<std::sync::Arc<CudaContext>> {
    // SAFETY: only probes whether libcuda can be loaded.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        assert!(
            !gpu_required(),
            "a GPU is required (NIXL_REQUIRE_GPU=1) but libcuda is not installed"
        );
        eprintln!("skipped: libcuda not found (no NVIDIA driver on this machine)");
        return None;
    }
    match CudaContext::new(0) {
        Ok(ctx) => Some(ctx),
        Err(e) => {
            assert!(
                !gpu_required(),
                "a GPU is required (NIXL_REQUIRE_GPU=1) but no CUDA device: {e}"
            );
            eprintln!("skipped: no CUDA device: {e}");
            None
        }
    }
}

#[test]
fn shm_write_from_cuda_memory() {
    watchdog(300);
    let Some(ctx) = cuda() else { return };
    let stream = ctx.default_stream();
    let info = match rdm_info("shm", base_caps() | Caps::HMEM) {
        Ok(info) => info,
        Err(e) => {
            assert!(matches!(e, Error::Unsupported { .. }), "{e:?}");
            eprintln!("REPORT: shm offers no FI_HMEM here: {e}");
            return;
        }
    };
    assert!(
        info.mr_mode().contains(MrMode::HMEM),
        "{:?}",
        info.mr_mode()
    );
    let a = Node::from_info(info.clone());
    let b = Node::from_info(info);
    let dest = a.av.insert(&b.ep.name().unwrap()).unwrap();
    let len = 1 << 20;
    let host = pattern(len, 77);
    let dev = stream.clone_htod(&host).expect("copy to device");
    stream.synchronize().unwrap();
    let (dptr, _sync) = dev.device_ptr(&stream);
    // SAFETY: `dev` (device memory of device 0) outlives the region and the write.
    let mr = unsafe {
        MemoryRegion::reg_hmem(
            &a.domain,
            Some(&a.ep),
            dptr,
            len,
            Access::ALL,
            HmemIface::Cuda(0),
        )
    };
    let mr = match mr {
        Ok(mr) => mr,
        Err(e) => {
            // A libfabric built without CUDA support refuses device memory: typed.
            assert!(
                matches!(e, Error::Unsupported { .. } | Error::Call { .. }),
                "untyped refusal: {e:?}"
            );
            eprintln!("REPORT: shm refused FI_HMEM_CUDA registration: {e}");
            return;
        }
    };
    let target = b.ep.alloc_registered(len, Access::ALL).unwrap();
    let remote = target.remote();
    let deadline = Instant::now() + T;
    let posted = a.ep.retry(deadline, || {
        // SAFETY: the device buffer stays alive and unmodified until the completion.
        unsafe {
            a.ep.write_raw(
                dptr as *const u8,
                len,
                Some(&mr),
                dest,
                remote.address_at(0),
                remote.key,
                9,
            )
        }
    });
    match posted.and_then(|()| a.cq.wait_for(9, T).map(drop)) {
        Ok(()) => assert!(
            target.to_vec_volatile() == host,
            "bytes written from GPU memory differ"
        ),
        Err(e) => {
            assert!(e.errno().is_some(), "untyped failure: {e:?}");
            panic!("write from CUDA memory failed: {e}");
        }
    }
}
