//! Host test: on a machine without the RDMA subsystem, `ibv_get_device_list` returns NULL
//! with `errno == ENOSYS` (or an empty list) and nothing crashes.

use ibverbs_sys::*;

#[test]
fn device_list_without_rdma_subsystem() {
    if std::env::var_os("RDMA_TEST_DEVICE").is_some()
        || std::path::Path::new("/sys/class/infiniband").exists()
    {
        println!("skipped: this machine has an RDMA subsystem (test is for hosts without one)");
        return;
    }
    let mut num: std::ffi::c_int = -1;
    // SAFETY: `num` is a valid out-pointer; the returned list is freed below.
    let list = unsafe { ibv_get_device_list(&mut num) };
    if list.is_null() {
        let errno = std::io::Error::last_os_error().raw_os_error();
        assert_eq!(
            errno,
            Some(libc::ENOSYS),
            "NULL device list with an unexpected errno"
        );
    } else {
        assert_eq!(num, 0, "devices listed on a host without RDMA support");
        // SAFETY: `list` came from ibv_get_device_list and is freed once.
        unsafe { ibv_free_device_list(list) };
    }
}
