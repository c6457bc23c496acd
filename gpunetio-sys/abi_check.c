/* Compiled by build.rs with the host C compiler: the header's static asserts then hold
 * for host C code too (the device side is checked by NVRTC, Rust by const asserts). */
#include "gpunetio/gio_abi.h"

uint32_t gio_abi_check_version(void) { return GIO_ABI_VERSION; }

/* The mlx5 handler's structs: their static asserts, for host C. */
#include "gpunetio/gio_mlx5.cuh"
