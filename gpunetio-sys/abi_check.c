/* Compiled by build.rs with the host C compiler: the header's static asserts then hold
 * for host C code too (the device side is checked by NVRTC, Rust by const asserts). */
#include "gpunetio/gio_abi.h"

uint32_t gio_abi_check_version(void) { return GIO_ABI_VERSION; }
