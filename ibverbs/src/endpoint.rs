//! The record two peers exchange to connect a pair of QPs: a leaf module beside the
//! QP, so that address handles (`pd.rs`) are built from it without importing `qp.rs`.

use crate::device::{Gid, Mtu};
use serde::{Deserialize, Serialize};

/// What a peer needs to connect to a QP: exchange it over any side channel (it is
/// `serde`-serializable).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoint {
    /// QP number.
    pub qp_num: u32,
    /// First packet sequence number this QP sends with.
    pub psn: u32,
    /// GID (RoCE; zero on InfiniBand without GRH).
    pub gid: Gid,
    /// LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Active MTU of the port.
    pub mtu: Mtu,
}
