//! NIC handler selection without a GPU: `Auto` resolves to `Mlx5` exactly when the
//! mlx5 probe finds a ConnectX with DEVX, else to `CpuProxy` with the probe's reason;
//! the DEVX bring-up refuses a machine without ConnectX with `Unsupported` naming why.
//! On a ConnectX machine set `GPUNETIO_REQUIRE_MLX5=1`: then `Auto` must pick `Mlx5`.

use gpunetio::queue_pair::{resolve, Resolution};
use gpunetio::{Error, NicHandler};

fn mlx5_required() -> bool {
    std::env::var("GPUNETIO_REQUIRE_MLX5").is_ok_and(|v| v == "1")
}

#[test]
fn auto_follows_the_mlx5_probe_and_says_why_it_falls_back() {
    let resolution = resolve(NicHandler::Auto);
    match gpunetio::mlx5::probe() {
        Ok(dev) => {
            assert_eq!(
                resolution,
                Resolution {
                    handler: NicHandler::Mlx5,
                    fallback_reason: None
                },
                "{dev:?} opens with DEVX"
            );
        }
        Err(e) => {
            assert!(!mlx5_required(), "GPUNETIO_REQUIRE_MLX5=1 but {e}");
            assert!(matches!(e, Error::Unsupported(_)), "{e:?}");
            assert_eq!(resolution.handler, NicHandler::CpuProxy);
            let why = resolution.fallback_reason.expect("a reason");
            assert_eq!(why, e.to_string());
            assert!(why.contains("native mlx5 handler"), "{why}");
            eprintln!("Auto -> CpuProxy: {why}");
        }
    }
    // Asking for a handler explicitly never consults the probe.
    assert_eq!(resolve(NicHandler::CpuProxy).handler, NicHandler::CpuProxy);
    assert_eq!(
        resolve(NicHandler::IntraNode).handler,
        NicHandler::IntraNode
    );
    assert_eq!(resolve(NicHandler::Mlx5).handler, NicHandler::Mlx5);
}

#[cfg(feature = "mlx5")]
#[test]
fn devx_bring_up_without_connectx_is_unsupported_with_the_reason() {
    use gpunetio::mlx5::DevxContext;
    match DevxContext::open(None) {
        Ok(ctx) => {
            // A ConnectX with DEVX: the protection domain has a number.
            eprintln!("DEVX opens here: {ctx:?}");
            assert!(gpunetio::mlx5::probe().is_ok());
        }
        Err(Error::Unsupported(why)) => {
            assert!(!mlx5_required(), "GPUNETIO_REQUIRE_MLX5=1 but {why}");
            assert!(why.contains("native mlx5 handler"), "{why}");
        }
        Err(other) => panic!("expected Unsupported, got {other:?}"),
    }
    // A device that does not exist is a verbs error naming it, not a panic.
    match DevxContext::open(Some("gio_no_such_device")) {
        Err(e) => assert!(e.to_string().contains("gio_no_such_device"), "{e}"),
        Ok(ctx) => panic!("opened a device that does not exist: {ctx:?}"),
    }
}
