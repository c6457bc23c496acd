//! What the tools' command-line tests share: running a binary to its end with both pipes
//! drained and a bound on how long it may take.

use std::io::Read;
use std::process::Child;
use std::time::{Duration, Instant};

/// What a run left.
pub struct Outcome {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

/// Waits for `child` (its stdout and stderr piped), killing it and failing the test
/// after `limit`. Both pipes are read while waiting, so a chatty run cannot block on a
/// full pipe.
pub fn finish(mut child: Child, what: &str, limit: Duration) -> Outcome {
    let read = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let out = read(Box::new(child.stdout.take().unwrap()));
    let err = read(Box::new(child.stderr.take().unwrap()));
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what}: still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Outcome {
        code: status.code(),
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    }
}
