//! Which NIC is closest to a buffer: PCIe/NUMA topology for rail choice.
//!
//! A [`Topology`] is a tree — machine, packages/groups, NUMA locality, PCI host
//! bridges, PCIe switch ports, PCI devices, and the OS devices on them (`mlx5_0`,
//! `cuda0`) — read from either
//! - an hwloc XML export (`lstopo --of xml`, hwloc 2.x format; [`Topology::from_hwloc_xml`]),
//!   the format NIXL's own topology tests feed, or
//! - Linux sysfs for the RDMA devices in use ([`Topology::from_sysfs`]): each device's
//!   PCI path (`/sys/class/infiniband/<dev>/device`) and `numa_node`.
//!
//! The choice itself: the distance between two PCI devices is the number of tree edges
//! between them, so a NIC behind the same PCIe switch as a GPU beats one behind the
//! same host bridge, which beats one on the same NUMA node, which beats one across the
//! socket interconnect. [`Topology::assign_nics`] gives each GPU the nearest NIC,
//! spreading GPUs that are equally near several NICs over them (one-to-one where the
//! hardware allows); [`Topology::nics_near_numa`] gives the NICs local to a NUMA node
//! (DRAM buffers).
//!
//! Why not libhwloc: `hwloc2` panics on NUMA/PCI queries with hwloc 2.9 (Debian 12's),
//! and `hwlocality` would make libhwloc-dev a build requirement of every crate using
//! `nixl`, for what is a read of a small, stable XML format and of two sysfs files per
//! device. The XML reader here accepts the subset hwloc writes: elements, attributes,
//! comments, processing instructions, a DOCTYPE, and the five predefined and numeric
//! character entities.

use crate::error::{Error, Result};
use std::collections::BTreeSet;
use std::fmt;
use std::path::Path;
use std::str::FromStr;

/// A PCI address `domain:bus:device.function`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PciAddr {
    /// PCI domain (segment).
    pub domain: u16,
    /// Bus number.
    pub bus: u8,
    /// Device number.
    pub dev: u8,
    /// Function number.
    pub func: u8,
}

impl FromStr for PciAddr {
    type Err = Error;

    /// `0000:17:00.0` (or `17:00.0`, domain 0), as hwloc, sysfs and CUDA's
    /// `cudaDeviceGetPCIBusId` (upper case, 8-digit domain accepted) write it.
    fn from_str(s: &str) -> Result<Self> {
        let bad = || Error::InvalidParam(format!("`{s}` is not a PCI address"));
        let (rest, func) = s.rsplit_once('.').ok_or_else(bad)?;
        let mut parts: Vec<&str> = rest.split(':').collect();
        if parts.len() == 2 {
            parts.insert(0, "0");
        }
        let [domain, bus, dev] = parts[..] else {
            return Err(bad());
        };
        let domain = u32::from_str_radix(domain, 16).map_err(|_| bad())?;
        Ok(PciAddr {
            domain: u16::try_from(domain).map_err(|_| bad())?,
            bus: u8::from_str_radix(bus, 16).map_err(|_| bad())?,
            dev: u8::from_str_radix(dev, 16).map_err(|_| bad())?,
            func: u8::from_str_radix(func, 16).map_err(|_| bad())?,
        })
    }
}

impl fmt::Display for PciAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.dev, self.func
        )
    }
}

/// What a tree node is.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Kind {
    /// Machine, package, group, die, NUMA node, cache, core …: carries locality.
    Normal,
    /// A PCI bridge (host bridge or switch port).
    Bridge,
    /// A PCI function.
    PciDev { addr: PciAddr, class: u16 },
    /// An OS device (`mlx5_0`, `cuda0`, `ib0`, …).
    OsDev { name: String },
}

#[derive(Debug, Clone)]
struct Node {
    kind: Kind,
    parent: Option<usize>,
    depth: usize,
    /// NUMA nodes of a normal object (hwloc's nodeset), empty when unknown.
    numa: BTreeSet<u32>,
}

/// A NIC as the topology sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nic {
    /// The verbs device name (`mlx5_0`).
    pub name: String,
    /// Its PCI function, when it has one (a soft device such as `rxe0` has none).
    pub pci: Option<PciAddr>,
    /// The NUMA nodes it is local to (empty when unknown).
    pub numa: BTreeSet<u32>,
}

/// The machine's topology (see the module docs).
#[derive(Debug, Clone)]
pub struct Topology {
    nodes: Vec<Node>,
}

impl Topology {
    fn push(&mut self, kind: Kind, parent: Option<usize>, numa: BTreeSet<u32>) -> usize {
        let depth = parent.map_or(0, |p| self.nodes[p].depth + 1);
        self.nodes.push(Node {
            kind,
            parent,
            depth,
            numa,
        });
        self.nodes.len() - 1
    }

    /// Reads an hwloc 2.x XML export.
    pub fn from_hwloc_xml(text: &str) -> Result<Self> {
        let mut topo = Topology { nodes: Vec::new() };
        // The element stack: for each open element, the node it made (if any).
        let mut stack: Vec<Option<usize>> = Vec::new();
        let mut saw_topology = false;
        for event in XmlReader::new(text) {
            match event? {
                XmlEvent::Open {
                    name,
                    attrs,
                    self_closing,
                } => {
                    let parent = stack.iter().rev().find_map(|n| *n);
                    let node = if name == "topology" {
                        saw_topology = true;
                        None
                    } else if name == "object" {
                        Some(topo.object(&attrs, parent)?)
                    } else {
                        None
                    };
                    if !self_closing {
                        stack.push(node);
                    }
                }
                XmlEvent::Close => {
                    stack.pop();
                }
            }
        }
        if !saw_topology || topo.nodes.is_empty() {
            return Err(Error::InvalidParam(
                "hwloc XML: no <topology> with objects".into(),
            ));
        }
        Ok(topo)
    }

    /// Reads an hwloc XML file.
    pub fn from_hwloc_xml_file(path: &Path) -> Result<Self> {
        Self::from_hwloc_xml(&std::fs::read_to_string(path)?)
    }

    fn object(&mut self, attrs: &[(String, String)], parent: Option<usize>) -> Result<usize> {
        let get = |k: &str| attrs.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        let ty = get("type")
            .ok_or_else(|| Error::InvalidParam("hwloc XML: object without type".into()))?;
        let kind = match ty {
            "Bridge" => Kind::Bridge,
            "PCIDev" => {
                let busid = get("pci_busid").ok_or_else(|| {
                    Error::InvalidParam("hwloc XML: PCIDev without pci_busid".into())
                })?;
                // `pci_type="0207 [15b3:101b] …"`: the class comes first.
                let class = get("pci_type")
                    .and_then(|t| t.split_whitespace().next())
                    .and_then(|c| u16::from_str_radix(c, 16).ok())
                    .unwrap_or(0);
                Kind::PciDev {
                    addr: busid.parse()?,
                    class,
                }
            }
            "OSDev" => Kind::OsDev {
                name: get("name").unwrap_or_default().to_string(),
            },
            _ => Kind::Normal,
        };
        let numa = match (&kind, get("nodeset")) {
            (Kind::Normal, Some(set)) => parse_bitmap(set)?,
            _ => BTreeSet::new(),
        };
        let numa = if ty == "NUMANode" && numa.is_empty() {
            get("os_index")
                .and_then(|i| i.parse().ok())
                .into_iter()
                .collect()
        } else {
            numa
        };
        Ok(self.push(kind, parent, numa))
    }

    /// Builds the part of the topology that matters for `devices` (verbs device names)
    /// and `gpus` from sysfs under `root` (`/sys` on a live system): each device's chain
    /// of PCI bridges up to its host bridge, under the NUMA node sysfs reports. Devices
    /// without a PCI parent (soft-RoCE) are left out.
    pub fn from_sysfs(root: &Path, devices: &[&str], gpus: &[PciAddr]) -> Result<Self> {
        let mut topo = Topology { nodes: Vec::new() };
        let machine = topo.push(Kind::Normal, None, BTreeSet::new());
        let mut paths: Vec<(std::path::PathBuf, Option<String>)> = Vec::new();
        for dev in devices {
            let link = root.join("class/infiniband").join(dev).join("device");
            if let Ok(path) = std::fs::canonicalize(&link) {
                paths.push((path, Some(dev.to_string())));
            }
        }
        for gpu in gpus {
            let link = root.join("bus/pci/devices").join(gpu.to_string());
            if let Ok(path) = std::fs::canonicalize(&link) {
                paths.push((path, None));
            }
        }
        // (NUMA node, host bridge name) → node; then PCI address → node.
        let mut numa_nodes: Vec<(Option<u32>, usize)> = Vec::new();
        let mut hosts: Vec<(String, Option<u32>, usize)> = Vec::new();
        let mut pci: Vec<(PciAddr, usize)> = Vec::new();
        for (path, name) in paths {
            let numa = std::fs::read_to_string(path.join("numa_node"))
                .ok()
                .and_then(|s| s.trim().parse::<i64>().ok())
                .and_then(|n| u32::try_from(n).ok());
            let group = match numa_nodes.iter().find(|(n, _)| *n == numa) {
                Some((_, g)) => *g,
                None => {
                    let g = topo.push(Kind::Normal, Some(machine), numa.into_iter().collect());
                    numa_nodes.push((numa, g));
                    g
                }
            };
            let comps: Vec<String> = path
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            let Some(host_at) = comps.iter().position(|c| c.starts_with("pci")) else {
                continue;
            };
            let host_name = comps[host_at].clone();
            let mut parent = match hosts.iter().find(|(h, n, _)| *h == host_name && *n == numa) {
                Some((_, _, b)) => *b,
                None => {
                    let b = topo.push(Kind::Bridge, Some(group), BTreeSet::new());
                    hosts.push((host_name, numa, b));
                    b
                }
            };
            let addrs: Vec<PciAddr> = comps[host_at + 1..]
                .iter()
                .map_while(|c| c.parse().ok())
                .collect();
            for (i, addr) in addrs.iter().enumerate() {
                let last = i + 1 == addrs.len();
                parent = match pci.iter().find(|(a, _)| a == addr) {
                    Some((_, n)) => *n,
                    None => {
                        // Every PCI function above the device is a bridge (switch port).
                        let kind = if last {
                            Kind::PciDev {
                                addr: *addr,
                                class: 0,
                            }
                        } else {
                            Kind::Bridge
                        };
                        let n = topo.push(kind, Some(parent), BTreeSet::new());
                        pci.push((*addr, n));
                        n
                    }
                };
            }
            if let Some(name) = name {
                topo.push(Kind::OsDev { name }, Some(parent), BTreeSet::new());
            }
        }
        Ok(topo)
    }

    /// The NUMA nodes a node is local to: those of its nearest normal ancestor.
    fn locality(&self, mut i: usize) -> BTreeSet<u32> {
        loop {
            let n = &self.nodes[i];
            if n.kind == Kind::Normal && !n.numa.is_empty() {
                return n.numa.clone();
            }
            match n.parent {
                Some(p) => i = p,
                None => return BTreeSet::new(),
            }
        }
    }

    /// The PCI function an OS device hangs off (itself for a PCI function).
    fn pci_of(&self, i: usize) -> Option<usize> {
        let mut at = Some(i);
        while let Some(j) = at {
            if matches!(self.nodes[j].kind, Kind::PciDev { .. }) {
                return Some(j);
            }
            at = self.nodes[j].parent;
        }
        None
    }

    fn find_osdev(&self, name: &str) -> Option<usize> {
        self.nodes
            .iter()
            .position(|n| matches!(&n.kind, Kind::OsDev { name: m } if m == name))
    }

    fn find_pci(&self, addr: PciAddr) -> Option<usize> {
        self.nodes
            .iter()
            .position(|n| matches!(n.kind, Kind::PciDev { addr: a, .. } if a == addr))
    }

    /// Number of tree edges between two nodes.
    fn hops(&self, a: usize, b: usize) -> usize {
        let (mut a, mut b, mut n) = (a, b, 0);
        while a != b {
            if self.nodes[a].depth >= self.nodes[b].depth {
                a = self.nodes[a].parent.expect("deeper node has a parent");
            } else {
                b = self.nodes[b].parent.expect("deeper node has a parent");
            }
            n += 1;
        }
        n
    }

    /// Every RDMA device the topology knows (OS devices named by verbs: on hwloc's
    /// OpenFabrics devices and sysfs' InfiniBand class), in tree order.
    pub fn nics(&self) -> Vec<Nic> {
        let mut out: Vec<Nic> = Vec::new();
        for (i, n) in self.nodes.iter().enumerate() {
            let Kind::OsDev { name } = &n.kind else {
                continue;
            };
            let pci = self.pci_of(i);
            let is_rdma_class = pci.is_some_and(|p| {
                matches!(self.nodes[p].kind, Kind::PciDev { class, .. } if class >> 8 == 0x02 || class >> 8 == 0x0c || class == 0)
            });
            if !is_rdma_class || !looks_like_verbs_name(name) {
                continue;
            }
            out.push(Nic {
                name: name.clone(),
                pci: pci.map(|p| match self.nodes[p].kind {
                    Kind::PciDev { addr, .. } => addr,
                    _ => unreachable!("pci_of returns PCI functions"),
                }),
                numa: self.locality(i),
            });
        }
        out
    }

    /// GPUs: PCI functions of display/3D class (0x03xx), by address.
    pub fn gpus(&self) -> Vec<PciAddr> {
        let mut out: Vec<PciAddr> = self
            .nodes
            .iter()
            .filter_map(|n| match n.kind {
                Kind::PciDev { addr, class } if class >> 8 == 0x03 => Some(addr),
                _ => None,
            })
            .collect();
        out.sort();
        out
    }

    /// The distance in tree edges between a PCI function and a NIC (by name), if both
    /// are in the topology.
    pub fn distance(&self, pci: PciAddr, nic: &str) -> Option<usize> {
        let a = self.find_pci(pci)?;
        let b = self.pci_of(self.find_osdev(nic)?)?;
        Some(self.hops(a, b))
    }

    /// The nearest of `nics` for each GPU, spreading GPUs that are equally near several
    /// NICs over them (greedy in GPU order: nearest first, then least loaded, then the
    /// order of `nics`). `None` for a GPU that is not in the topology or when none of
    /// `nics` is.
    pub fn assign_nics(&self, gpus: &[PciAddr], nics: &[&str]) -> Vec<Option<String>> {
        let mut load = vec![0usize; nics.len()];
        gpus.iter()
            .map(|gpu| {
                let best = nics
                    .iter()
                    .enumerate()
                    .filter_map(|(i, nic)| self.distance(*gpu, nic).map(|d| (d, load[i], i)))
                    .min()?;
                load[best.2] += 1;
                Some(nics[best.2].to_string())
            })
            .collect()
    }

    /// The nearest of `nics` to one GPU (ties: the first in `nics`).
    pub fn nic_for_gpu(&self, gpu: PciAddr, nics: &[&str]) -> Option<String> {
        self.assign_nics(&[gpu], nics).pop().flatten()
    }

    /// Those of `nics` local to NUMA node `node`; all of them that the topology places
    /// when none is local (a buffer on a node without a NIC reaches every NIC across
    /// the interconnect alike).
    pub fn nics_near_numa(&self, node: u32, nics: &[&str]) -> Vec<String> {
        let known: Vec<Nic> = self.nics();
        let placed: Vec<&Nic> = nics
            .iter()
            .filter_map(|n| known.iter().find(|k| k.name == *n))
            .collect();
        let local: Vec<String> = placed
            .iter()
            .filter(|k| k.numa.contains(&node))
            .map(|k| k.name.clone())
            .collect();
        if local.is_empty() {
            placed.iter().map(|k| k.name.clone()).collect()
        } else {
            local
        }
    }
}

/// Verbs device names (`mlx5_0`, `bnxt_re1`, `irdma0`, `rxe0`, `efa_0`, `hfi1_0`,
/// `qedr0`, `siw0`), as opposed to netdevs (`ib0`, `eth0`) and GPU OS devices.
fn looks_like_verbs_name(name: &str) -> bool {
    const PREFIXES: &[&str] = &[
        "mlx4_",
        "mlx5_",
        "bnxt_re",
        "irdma",
        "i40iw",
        "rxe",
        "siw",
        "efa",
        "hfi1_",
        "qib",
        "qedr",
        "hns_",
        "erdma",
        "mana_",
        "cxgb4_",
        "ocrdma",
        "vmw_pvrdma",
        "ionic_",
    ];
    PREFIXES.iter().any(|p| name.starts_with(p))
}

/// hwloc bitmap: `0x00000003`, `0x00000001,0x00000000` (32-bit groups, most
/// significant first), `0x0` or empty → empty; `0xf...f` (infinite) is refused.
fn parse_bitmap(s: &str) -> Result<BTreeSet<u32>> {
    let bad = || Error::InvalidParam(format!("hwloc XML: bitmap `{s}`"));
    let mut out = BTreeSet::new();
    let groups: Vec<&str> = s.split(',').collect();
    for (g, group) in groups.iter().rev().enumerate() {
        let hex = group.trim().trim_start_matches("0x");
        if hex.is_empty() {
            continue;
        }
        if hex.contains("...") {
            return Err(bad());
        }
        let value = u64::from_str_radix(hex, 16).map_err(|_| bad())?;
        let shift = (g * 32) as u32;
        for bit in 0..64u32 {
            if value >> bit & 1 == 1 {
                out.insert(shift.checked_add(bit).ok_or_else(bad)?);
            }
        }
    }
    Ok(out)
}

/// The NUMA node holding the page at `addr` (`get_mempolicy(MPOL_F_NODE|MPOL_F_ADDR)`),
/// `None` where the kernel has no NUMA support or the page is not mapped yet.
pub fn numa_node_of(addr: u64) -> Option<u32> {
    const MPOL_F_NODE: libc::c_ulong = 1;
    const MPOL_F_ADDR: libc::c_ulong = 2;
    let mut node: libc::c_int = -1;
    // SAFETY: get_mempolicy only writes `node` (one int; no nodemask asked for) and
    // reads nothing at `addr` (it looks the address up in the process' mappings).
    let ret = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut node as *mut libc::c_int,
            std::ptr::null_mut::<libc::c_ulong>(),
            0 as libc::c_ulong,
            addr as *mut libc::c_void,
            MPOL_F_NODE | MPOL_F_ADDR,
        )
    };
    (ret == 0 && node >= 0).then_some(node as u32)
}

// ---------------------------------------------------------------------------------------
// A minimal XML reader (the subset hwloc writes)

enum XmlEvent {
    Open {
        name: String,
        attrs: Vec<(String, String)>,
        self_closing: bool,
    },
    Close,
}

struct XmlReader<'a> {
    s: &'a str,
    at: usize,
    done: bool,
}

impl<'a> XmlReader<'a> {
    fn new(s: &'a str) -> Self {
        XmlReader {
            s,
            at: 0,
            done: false,
        }
    }

    fn err(&self, why: &str) -> Error {
        let line = self.s[..self.at.min(self.s.len())].matches('\n').count() + 1;
        Error::InvalidParam(format!("hwloc XML: line {line}: {why}"))
    }

    fn skip_past(&mut self, end: &str) -> Result<()> {
        match self.s[self.at..].find(end) {
            Some(i) => {
                self.at += i + end.len();
                Ok(())
            }
            None => Err(self.err(&format!("unterminated, expected `{end}`"))),
        }
    }

    fn next_event(&mut self) -> Result<Option<XmlEvent>> {
        loop {
            // Text between tags is ignored (hwloc keeps data in attributes).
            let Some(lt) = self.s[self.at..].find('<') else {
                return Ok(None);
            };
            self.at += lt;
            let rest = &self.s[self.at..];
            if rest.starts_with("<?") {
                self.skip_past("?>")?;
            } else if rest.starts_with("<!--") {
                self.skip_past("-->")?;
            } else if rest.starts_with("<!") {
                self.skip_past(">")?;
            } else if rest.starts_with("</") {
                self.skip_past(">")?;
                return Ok(Some(XmlEvent::Close));
            } else {
                return self.open_tag().map(Some);
            }
        }
    }

    fn open_tag(&mut self) -> Result<XmlEvent> {
        self.at += 1;
        let name = self.name()?;
        let mut attrs = Vec::new();
        loop {
            self.skip_ws();
            let rest = &self.s[self.at..];
            if rest.starts_with("/>") {
                self.at += 2;
                return Ok(XmlEvent::Open {
                    name,
                    attrs,
                    self_closing: true,
                });
            }
            if rest.starts_with('>') {
                self.at += 1;
                return Ok(XmlEvent::Open {
                    name,
                    attrs,
                    self_closing: false,
                });
            }
            if rest.is_empty() {
                return Err(self.err("unterminated tag"));
            }
            let key = self.name()?;
            self.skip_ws();
            if !self.s[self.at..].starts_with('=') {
                return Err(self.err(&format!("attribute `{key}` without a value")));
            }
            self.at += 1;
            self.skip_ws();
            let quote = self.s[self.at..]
                .chars()
                .next()
                .filter(|c| *c == '"' || *c == '\'')
                .ok_or_else(|| self.err("attribute value not quoted"))?;
            self.at += 1;
            let end = self.s[self.at..]
                .find(quote)
                .ok_or_else(|| self.err("unterminated attribute value"))?;
            let raw = &self.s[self.at..self.at + end];
            self.at += end + 1;
            attrs.push((key, self.unescape(raw)?));
        }
    }

    fn skip_ws(&mut self) {
        let rest = &self.s[self.at..];
        self.at += rest.len() - rest.trim_start().len();
    }

    fn name(&mut self) -> Result<String> {
        let rest = &self.s[self.at..];
        let len = rest
            .find(|c: char| !(c.is_alphanumeric() || matches!(c, '_' | '-' | '.' | ':')))
            .unwrap_or(rest.len());
        if len == 0 {
            return Err(self.err("expected a name"));
        }
        self.at += len;
        Ok(rest[..len].to_string())
    }

    fn unescape(&self, raw: &str) -> Result<String> {
        let mut out = String::with_capacity(raw.len());
        let mut rest = raw;
        while let Some(amp) = rest.find('&') {
            out.push_str(&rest[..amp]);
            let semi = rest[amp..]
                .find(';')
                .ok_or_else(|| self.err("unterminated entity"))?;
            let entity = &rest[amp + 1..amp + semi];
            let c = match entity {
                "lt" => '<',
                "gt" => '>',
                "amp" => '&',
                "quot" => '"',
                "apos" => '\'',
                _ => {
                    let code = if let Some(hex) = entity.strip_prefix("#x") {
                        u32::from_str_radix(hex, 16).ok()
                    } else if let Some(dec) = entity.strip_prefix('#') {
                        dec.parse().ok()
                    } else {
                        None
                    };
                    code.and_then(char::from_u32)
                        .ok_or_else(|| self.err(&format!("unknown entity `&{entity};`")))?
                }
            };
            out.push(c);
            rest = &rest[amp + semi + 1..];
        }
        out.push_str(rest);
        Ok(out)
    }
}

impl Iterator for XmlReader<'_> {
    type Item = Result<XmlEvent>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        match self.next_event() {
            Ok(Some(e)) => Some(Ok(e)),
            Ok(None) => None,
            Err(e) => {
                self.done = true;
                Some(Err(e))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_addresses_parse_and_print() {
        let a: PciAddr = "0000:17:00.1".parse().unwrap();
        assert_eq!(
            a,
            PciAddr {
                domain: 0,
                bus: 0x17,
                dev: 0,
                func: 1
            }
        );
        assert_eq!(a.to_string(), "0000:17:00.1");
        assert_eq!(
            "00000000:B1:1F.7".parse::<PciAddr>().unwrap().to_string(),
            "0000:b1:1f.7"
        );
        assert_eq!("3b:00.0".parse::<PciAddr>().unwrap().bus, 0x3b);
        for bad in [
            "",
            "17:00",
            "zz:00.0",
            "0000:100:00.0",
            "1:2:3:4.0",
            "10000:00:00.0",
        ] {
            assert!(bad.parse::<PciAddr>().is_err(), "{bad}");
        }
    }

    #[test]
    fn bitmaps_parse() {
        assert_eq!(parse_bitmap("0x00000003").unwrap(), [0, 1].into());
        assert_eq!(parse_bitmap("0x00000001,0x00000000").unwrap(), [32].into());
        assert!(parse_bitmap("0x0").unwrap().is_empty());
        assert!(parse_bitmap("0xf...f").is_err());
        assert!(parse_bitmap("0xzz").is_err());
    }

    #[test]
    fn xml_reader_handles_what_hwloc_writes_and_reports_errors() {
        let xml = r#"<?xml version="1.0" encoding="UTF-8"?>
<!DOCTYPE topology SYSTEM "hwloc2.dtd">
<!-- a comment with <object> inside -->
<topology version="2.0">
  <object type="Machine" os_index='0' nodeset="0x1">
    <info name="DMIProductName" value="A &amp; B &lt;x&gt; &#65;&#x42;"/>
    <object type="PCIDev" pci_busid="0000:01:00.0" pci_type="0207 [15b3:1017] [15b3:0020] 00">
      <object type="OSDev" name="mlx5_0" osdev_type="3"/>
    </object>
  </object>
</topology>"#;
        let events: Vec<XmlEvent> = XmlReader::new(xml).collect::<Result<_>>().unwrap();
        let values: Vec<String> = events
            .iter()
            .filter_map(|e| match e {
                XmlEvent::Open { name, attrs, .. } if name == "info" => Some(attrs[1].1.clone()),
                _ => None,
            })
            .collect();
        assert_eq!(values, ["A & B <x> AB"]);
        let topo = Topology::from_hwloc_xml(xml).unwrap();
        assert_eq!(
            topo.nics(),
            vec![Nic {
                name: "mlx5_0".into(),
                pci: Some("0000:01:00.0".parse().unwrap()),
                numa: [0].into(),
            }]
        );
        for bad in [
            "<topology><object type=\"Machine\" nodeset=\"0x1\"",
            "<topology><object type=Machine/></topology>",
            "<topology><object type=\"PCIDev\"/></topology>",
            "<topology><object type=\"Machine\" x=\"&bogus;\"/></topology>",
            "<topology></topology>",
            "<object type=\"Machine\"/>",
        ] {
            let err = Topology::from_hwloc_xml(bad).unwrap_err();
            assert!(matches!(err, Error::InvalidParam(_)), "{bad}: {err}");
        }
    }

    #[test]
    fn sysfs_topology_places_devices_by_pci_path_and_numa_node() {
        let root = std::env::temp_dir().join(format!("nixl-topo-sysfs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let devices = root.join("devices");
        // Two NICs behind one switch on node 1, a GPU behind the same switch, and a NIC
        // on another host bridge of node 0.
        let switch = devices.join("pci0000:80/0000:80:01.0/0000:81:00.0");
        let nic_a = switch.join("0000:82:00.0/0000:83:00.0");
        let gpu = switch.join("0000:82:04.0/0000:84:00.0");
        let nic_b = switch.join("0000:82:08.0/0000:85:00.0");
        let nic_c = devices.join("pci0000:00/0000:00:02.0/0000:01:00.0");
        for (dir, node) in [(&nic_a, "1"), (&gpu, "1"), (&nic_b, "1"), (&nic_c, "0")] {
            std::fs::create_dir_all(dir).unwrap();
            std::fs::write(dir.join("numa_node"), format!("{node}\n")).unwrap();
        }
        let ib = root.join("class/infiniband");
        let pci = root.join("bus/pci/devices");
        for (name, dir) in [("mlx5_0", &nic_c), ("mlx5_1", &nic_a), ("mlx5_2", &nic_b)] {
            std::fs::create_dir_all(ib.join(name)).unwrap();
            std::os::unix::fs::symlink(dir, ib.join(name).join("device")).unwrap();
        }
        std::fs::create_dir_all(&pci).unwrap();
        std::os::unix::fs::symlink(&gpu, pci.join("0000:84:00.0")).unwrap();
        let gpu_addr: PciAddr = "0000:84:00.0".parse().unwrap();
        let nics = ["mlx5_0", "mlx5_1", "mlx5_2", "rxe0"];
        let topo = Topology::from_sysfs(&root, &nics, &[gpu_addr]).unwrap();
        let found = topo.nics();
        assert_eq!(found.len(), 3, "rxe0 has no PCI device: {found:?}");
        assert_eq!(topo.nics_near_numa(1, &nics), ["mlx5_1", "mlx5_2"]);
        assert_eq!(topo.nics_near_numa(0, &nics), ["mlx5_0"]);
        assert_eq!(topo.nic_for_gpu(gpu_addr, &nics).as_deref(), Some("mlx5_1"));
        assert!(topo.distance(gpu_addr, "mlx5_1") < topo.distance(gpu_addr, "mlx5_0"));
        let _ = std::fs::remove_dir_all(&root);
    }
}
