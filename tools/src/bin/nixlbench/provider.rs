//! LIBFABRIC provider choice: agent names that carry the provider, and which host a
//! peer is on.

use std::net::{IpAddr, SocketAddr, UdpSocket};

pub(crate) fn with_provider(role: &str, provider: Option<&str>) -> String {
    match provider {
        Some(p) => format!("{role}@{p}"),
        None => role.to_string(),
    }
}

pub(crate) fn provider_of(agent_name: &str) -> Option<&str> {
    agent_name.split_once('@').map(|(_, p)| p)
}

/// Whether `ip` is this host: loopback, unspecified (connecting to it reaches this host),
/// or an address of one of its interfaces (binding to it succeeds only then).
pub(crate) fn is_this_host(ip: IpAddr) -> bool {
    ip.is_loopback() || ip.is_unspecified() || UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TARGET;

    #[test]
    fn provider_names_and_hosts() {
        assert_eq!(
            with_provider(TARGET, Some("tcp;ofi_rxm")),
            "nixlbench-target@tcp;ofi_rxm"
        );
        assert_eq!(
            provider_of("nixlbench-target@tcp;ofi_rxm"),
            Some("tcp;ofi_rxm")
        );
        assert_eq!(provider_of(TARGET), None);
        assert!(is_this_host("127.0.0.1".parse().unwrap()));
        assert!(is_this_host("0.0.0.0".parse().unwrap()));
        // TEST-NET-3: never an address of this host.
        assert!(!is_this_host("203.0.113.7".parse().unwrap()));
    }
}
