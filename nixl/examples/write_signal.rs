//! Write and signal from a kernel, between two processes (NIXL's device-API example).
//!
//! The target registers a data buffer and a signal word in VRAM, listens for metadata,
//! and, once an initiator connected, sends it the two descriptors out of band (as a
//! notification); its kernel then spins on the signal and checks each round's data as
//! the signal reaches it. The initiator fetches the target's metadata, sends its own,
//! receives the descriptors, makes a WRITE request (data, signal), creates its GPU
//! handle, and launches a kernel that writes round r's slice and then adds 1 to the
//! signal, for every round (THREAD, WARP or BLOCK level).
//!
//! ```text
//! cargo run --release -p rdma-rs-nixl --features gpunetio --example write_signal -- target [--listen 127.0.0.1:5555]
//! cargo run --release -p rdma-rs-nixl --features gpunetio --example write_signal -- initiator 127.0.0.1:5555 [--level warp] [--rounds 16] [--slice 1048576]
//! ```

use gpunetio::cudarc::driver::{LaunchConfig, PushKernelArg};
use gpunetio::{DeviceBuffer, Gpu, HostBuffer};
use nixl::device;
use nixl::{Agent, AgentConfig, Desc, DescList, MemKind, XferOp};
use std::time::{Duration, Instant};

const TARGET: &str = "write-signal-target";
const INITIATOR: &str = "write-signal-initiator";

fn opt<T: std::str::FromStr>(args: &[String], key: &str, default: T) -> T {
    args.iter()
        .position(|a| a == key)
        .and_then(|i| args.get(i + 1))
        .map(|v| v.parse().ok().expect("a valid value"))
        .unwrap_or(default)
}

fn agent(name: &str, listen: Option<&str>) -> Agent {
    let config = AgentConfig {
        listen_addr: listen.map(|a| a.parse().expect("an address")),
        ..AgentConfig::default()
    };
    let agent = Agent::new(name, config).expect("agent");
    agent
        .create_backend("GPUNETIO", &Default::default())
        .expect("the GPUNETIO backend (a GPU and NVRTC are needed)");
    agent
}

fn wait_notif(agent: &Agent, from: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(mut v) = agent.get_notifs().remove(from) {
            return String::from_utf8(v.remove(0)).expect("text");
        }
        assert!(Instant::now() < deadline, "no notification from {from}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn module(gpu: &Gpu) -> std::sync::Arc<gpunetio::cudarc::driver::CudaModule> {
    let (name, src) = device::DEVICE_SOURCES[1];
    let ptx = gpunetio::device_code::compile(name, src, &device::compile_options(gpu).unwrap())
        .expect("kernels compile");
    gpu.context().load_module(ptx).unwrap()
}

fn target(args: &[String]) {
    let listen: String = opt(args, "--listen", "127.0.0.1:5555".to_string());
    let gpu = Gpu::open(0).expect("a GPU");
    let m = module(&gpu);
    let t = agent(TARGET, Some(&listen));
    let capacity: u64 = opt(args, "--capacity", 64u64 << 20);
    let data = DeviceBuffer::alloc(&gpu, capacity as usize).unwrap();
    let signal = DeviceBuffer::alloc(&gpu, 256).unwrap();
    // SAFETY: both live until the process exits.
    let _h = unsafe {
        t.register_mem(
            &DescList::from_descs(
                MemKind::Vram,
                [
                    Desc::new(data.ptr(), capacity, 0),
                    Desc::new(signal.ptr(), 8, 0),
                ],
            ),
            None,
        )
        .unwrap()
    };
    println!("target: listening on {}", t.listen_addr().unwrap());
    // The initiator announces itself and its run: "start SLICE ROUNDS SEED".
    let hello = wait_notif(&t, INITIATOR);
    let w: Vec<u64> = hello
        .split(' ')
        .skip(1)
        .map(|v| v.parse().unwrap())
        .collect();
    let (slice, rounds, seed) = (w[0], w[1] as u32, w[2] as u32);
    assert!(
        slice * u64::from(rounds) <= capacity,
        "the run does not fit"
    );
    device::prep_gpu_signal(&gpu, signal.ptr()).unwrap();
    let bad = DeviceBuffer::alloc(&gpu, 16).unwrap();
    bad.fill(0).unwrap();
    let stream = gpu.new_stream().unwrap();
    let f = m.load_function("wait_and_check").unwrap();
    let (s, d, b, timeout) = (signal.ptr(), data.ptr(), bad.ptr(), 60_000_000_000u64);
    let mut l = stream.launch_builder(&f);
    l.arg(&s)
        .arg(&d)
        .arg(&slice)
        .arg(&rounds)
        .arg(&seed)
        .arg(&timeout)
        .arg(&b);
    // SAFETY: wait_and_check(const u64*, const u8*, u64, unsigned, unsigned, u64, u64*)
    // over live buffers large enough (checked above).
    unsafe { l.launch(LaunchConfig::for_num_elems(256)) }.unwrap();
    // The descriptors, out of band: "ADDR LEN DEV ADDR LEN DEV".
    t.gen_notif(
        INITIATOR,
        format!(
            "{} {} 0 {} 8 0",
            data.ptr(),
            slice * u64::from(rounds),
            signal.ptr()
        )
        .as_bytes(),
    )
    .unwrap();
    stream.synchronize().unwrap();
    let v = bad.to_vec().unwrap();
    let wrong = u64::from_le_bytes(v[..8].try_into().unwrap());
    let seen = u64::from_le_bytes(v[8..].try_into().unwrap());
    println!("target: {seen} of {rounds} rounds signalled, {wrong} wrong bytes");
    t.gen_notif(INITIATOR, format!("{seen} {wrong}").as_bytes())
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    std::process::exit(if seen == u64::from(rounds) && wrong == 0 {
        0
    } else {
        1
    });
}

fn initiator(args: &[String]) {
    let addr = args
        .get(2)
        .expect("the target's address")
        .parse()
        .expect("an address");
    let level: String = opt(args, "--level", "warp".to_string());
    let rounds: u32 = opt(args, "--rounds", 16);
    let slice: u64 = opt(args, "--slice", 1 << 20);
    let seed = 5u32;
    let gpu = Gpu::open(0).expect("a GPU");
    let m = module(&gpu);
    let i = agent(INITIATOR, None);
    let name = i.fetch_remote_metadata(addr).unwrap();
    i.send_local_metadata(addr).unwrap();
    let len = slice * u64::from(rounds);
    let src = DeviceBuffer::alloc(&gpu, len as usize).unwrap();
    let one = DeviceBuffer::alloc(&gpu, 256).unwrap();
    let fill = m.load_function("fill_pattern").unwrap();
    let stream = gpu.context().default_stream();
    let p = src.ptr();
    let mut l = stream.launch_builder(&fill);
    l.arg(&p).arg(&slice).arg(&rounds).arg(&seed);
    // SAFETY: fill_pattern writes `len` bytes of `src`.
    unsafe { l.launch(LaunchConfig::for_num_elems(1 << 16)) }.unwrap();
    stream.synchronize().unwrap();
    // SAFETY: both live until the process exits.
    let _h = unsafe {
        i.register_mem(
            &DescList::from_descs(
                MemKind::Vram,
                [Desc::new(src.ptr(), len, 0), Desc::new(one.ptr(), 256, 0)],
            ),
            None,
        )
        .unwrap()
    };
    i.gen_notif(&name, format!("start {slice} {rounds} {seed}").as_bytes())
        .unwrap();
    let descs: Vec<u64> = wait_notif(&i, &name)
        .split(' ')
        .map(|v| v.parse().unwrap())
        .collect();
    let remote = DescList::from_descs(
        MemKind::Vram,
        [
            Desc::new(descs[0], descs[1], descs[2]),
            Desc::new(descs[3], descs[4], descs[5]),
        ],
    );
    let local = DescList::from_descs(
        MemKind::Vram,
        [Desc::new(src.ptr(), len, 0), Desc::new(one.ptr(), 8, 0)],
    );
    let req = i
        .create_xfer_req(XferOp::Write, &local, &remote, &name, None)
        .unwrap();
    let handle = req.create_gpu_xfer_req().unwrap();
    let (kernel, threads) = match level.as_str() {
        "thread" => ("write_signal_thread", 256),
        "warp" => ("write_signal_warp", 256),
        "block" => ("write_signal_block", 512),
        other => panic!("--level thread|warp|block, not {other}"),
    };
    let f = m.load_function(kernel).unwrap();
    let mut status = HostBuffer::alloc(&gpu, 8).unwrap();
    status.as_mut_slice().fill(0);
    let st = status.device_ptr().unwrap();
    let h = handle.raw();
    let t0 = Instant::now();
    let mut l = stream.launch_builder(&f);
    l.arg(&h).arg(&slice).arg(&rounds).arg(&st);
    // SAFETY: write_signal_*(nixlGpuXferReqH, u64, unsigned, int*); the request's memory
    // outlives the synchronized launch.
    unsafe {
        l.launch(LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        })
    }
    .unwrap();
    stream.synchronize().unwrap();
    let secs = t0.elapsed().as_secs_f64();
    let code = i32::from_le_bytes(status.as_slice()[..4].try_into().unwrap());
    let verdict = wait_notif(&i, &name);
    println!(
        "initiator: {level} level, {rounds} rounds of {slice} bytes in {:.3} ms ({:.2} GB/s incl. launch), device status {code}, target says (rounds seen, wrong bytes) = {verdict}",
        secs * 1e3,
        len as f64 / secs / 1e9
    );
    let ok = code == 0 && verdict == format!("{rounds} 0");
    std::process::exit(if ok { 0 } else { 1 });
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("target") => target(&args),
        Some("initiator") => initiator(&args),
        _ => {
            eprintln!("usage: write_signal target [--listen ADDR] | initiator ADDR [--level thread|warp|block] [--rounds N] [--slice BYTES]");
            std::process::exit(2);
        }
    }
}
