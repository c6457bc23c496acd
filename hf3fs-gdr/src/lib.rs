//! 3FS usrbio-style GPU-direct storage I/O (issue 12): host and GPU iovs, I/O rings in
//! shared memory and the daemon that serves them.
