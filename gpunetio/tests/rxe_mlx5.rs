//! The native mlx5 handler in the soft-RoCE guest (`cargo xtask test`,
//! `RDMA_TEST_DEVICE=rxe0`): rxe is not an mlx5 device, so the DEVX bring-up refuses
//! it with `Unsupported` naming why, and `Auto` picks `CpuProxy` with that reason.
//! Skips with a printed reason when `RDMA_TEST_DEVICE` is unset; fails when it names a
//! missing device.

#![cfg(feature = "mlx5")]

use gpunetio::mlx5::{probe, DevxContext};
use gpunetio::queue_pair::resolve;
use gpunetio::{Error, NicHandler};

fn device(test: &str) -> Option<String> {
    let Ok(name) = std::env::var("RDMA_TEST_DEVICE") else {
        println!("skipped {test}: RDMA_TEST_DEVICE not set (run via cargo xtask test)");
        return None;
    };
    let devices = gpunetio::mlx5::devices().expect("listing RDMA devices");
    let Some((_, mlx5)) = devices.iter().find(|(n, _)| *n == name) else {
        panic!("RDMA_TEST_DEVICE={name} is not among {devices:?}");
    };
    assert!(
        mlx5.is_none(),
        "{name} is an mlx5 device: this test is for rxe"
    );
    Some(name)
}

#[test]
fn rxe_mlx5_devx_bring_up_refuses_a_non_mlx5_device() {
    let Some(name) = device("rxe_mlx5_devx_bring_up_refuses_a_non_mlx5_device") else {
        return;
    };
    match DevxContext::open(Some(&name)) {
        Err(Error::Unsupported(why)) => {
            assert!(why.contains(&name), "{why}");
            assert!(why.contains("not an mlx5"), "{why}");
            eprintln!("{why}");
        }
        other => panic!("expected Unsupported, got {other:?}"),
    }
    // Without a name: the probe's reason lists the devices it saw.
    match DevxContext::open(None) {
        Err(Error::Unsupported(why)) => {
            assert!(why.contains("no mlx5 (ConnectX) device"), "{why}");
            assert!(why.contains(&name), "{why}");
        }
        other => panic!("expected Unsupported, got {other:?}"),
    }
}

#[test]
fn rxe_mlx5_auto_picks_the_cpu_proxy_and_says_why() {
    let Some(name) = device("rxe_mlx5_auto_picks_the_cpu_proxy_and_says_why") else {
        return;
    };
    let r = resolve(NicHandler::Auto);
    assert_eq!(r.handler, NicHandler::CpuProxy);
    let why = r.fallback_reason.expect("a reason");
    assert_eq!(
        why,
        probe()
            .expect_err("no mlx5 device in the guest")
            .to_string()
    );
    assert!(why.contains(&name), "{why}");
    eprintln!("Auto -> CpuProxy: {why}");
}
