#![cfg(feature = "libfabric")]
//! The staging scenarios VERBS runs too (`tests/common/staged.rs`), over LIBFABRIC's
//! tcp and shm providers without a GPU: DRAM registered as staged (`stage_dram=1`) goes
//! through exactly the protocol VRAM does, with `memcpy` in place of the device copies.

mod common;

use common::staged::StagedBackend;
use nixl::params;

/// `provider` itself (not shm to the agents of this host).
fn libfabric(provider: &str) -> StagedBackend {
    StagedBackend::new(
        "LIBFABRIC",
        params([("provider", provider), ("local_provider", "none")]),
    )
}

#[test]
fn staged_two_rails_many_descriptors_tcp() {
    let sizes: Vec<usize> = (0..1000).map(|i| 4096 + (i % 7) * 1000).collect();
    let tcp = libfabric("tcp;ofi_rxm");
    tcp.round_trip(true, true, &sizes, &[("num_rails", "2")]);
    tcp.round_trip(false, true, &sizes[..300], &[("num_rails", "2")]);
}

#[test]
fn staged_both_sides_tcp() {
    libfabric("tcp;ofi_rxm").round_trip(true, true, &[1, 4097, (3 << 20) + 5], &[]);
}

#[test]
fn staged_each_side_and_both_shm() {
    for (i, t) in [(true, false), (false, true), (true, true)] {
        libfabric("shm").round_trip(i, t, &[1, 4097, (3 << 20) + 5, 1 << 20], &[]);
    }
}

#[test]
fn staged_notification_arrives_only_after_the_last_chunk_landed() {
    for (provider, init_stages) in [("tcp;ofi_rxm", true), ("shm", false), ("shm", true)] {
        libfabric(provider).notification_only_after_the_last_chunk(init_stages, 24 << 20, &[]);
    }
}

#[test]
fn staged_without_progress_threads_the_callers_polls_drive_the_pipeline() {
    for provider in ["tcp;ofi_rxm", "shm"] {
        libfabric(provider).without_progress_threads((5 << 20) + 3);
    }
}

/// Default parameters: the agents of this host reach each other through their shm rails,
/// staged memory included.
#[test]
fn staged_over_the_shm_rails_of_default_parameters() {
    let default = StagedBackend::new("LIBFABRIC", params([]));
    default.round_trip(true, true, &[1, 4097, (3 << 20) + 5], &[]);
    default.notification_only_after_the_last_chunk(true, 24 << 20, &[]);
}
