//! A throwaway etcd server on loopback for tests (Debian: `etcd-server`;
//! `NIXL_TEST_ETCD_BIN` names another binary), shared by nixl's etcd tests and tools'
//! nixlbench etcd tests (`#[path]`-included: one copy of the startup dance).

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long etcd may take to listen.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// A running etcd with its own data folder; killed and removed on drop.
pub struct EtcdServer {
    child: Child,
    /// Its folder (data, `etcd.log`, and anything a test wants to put beside them).
    pub dir: PathBuf,
    /// The client URL (`http://127.0.0.1:PORT`).
    pub endpoint: String,
}

/// A TCP port nothing listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl EtcdServer {
    /// The client address.
    #[allow(dead_code)] // not every test crate asks
    pub fn addr(&self) -> SocketAddr {
        self.endpoint
            .trim_start_matches("http://")
            .parse()
            .expect("an IP:port endpoint")
    }

    /// Starts etcd in a fresh folder named after this process and `tag`, and waits until
    /// it listens.
    pub fn start(tag: &str) -> Self {
        let bin = std::env::var("NIXL_TEST_ETCD_BIN").unwrap_or_else(|_| "etcd".into());
        let dir = std::env::temp_dir().join(format!("etcd-test-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (client, peer) = (free_port(), free_port());
        let client_url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let log = std::fs::File::create(dir.join("etcd.log")).unwrap();
        let child = Command::new(&bin)
            .arg("--name")
            .arg("nixl-test")
            .arg("--data-dir")
            .arg(dir.join("data"))
            .args(["--listen-client-urls", &client_url])
            .args(["--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("nixl-test={peer_url}")])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot run `{bin}` ({e}): install etcd (Debian: etcd-server) or set NIXL_TEST_ETCD_BIN")
            });
        let mut etcd = EtcdServer {
            child,
            dir,
            endpoint: client_url,
        };
        let addr: SocketAddr = format!("127.0.0.1:{client}").parse().unwrap();
        let deadline = Instant::now() + START_TIMEOUT;
        while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            if let Some(status) = etcd.child.try_wait().unwrap() {
                let log = std::fs::read_to_string(etcd.dir.join("etcd.log")).unwrap_or_default();
                panic!("etcd exited ({status}) before listening:\n{log}");
            }
            assert!(Instant::now() < deadline, "etcd never listened on {addr}");
            std::thread::sleep(Duration::from_millis(50));
        }
        etcd
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
