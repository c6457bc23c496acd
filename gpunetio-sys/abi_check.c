/* Compiled by build.rs with the host C compiler: the header's static asserts then hold
 * for host C code too (the device side is checked by NVRTC, Rust by const asserts). */
#include "gpunetio/gio_abi.h"

uint32_t gio_abi_check_version(void) { return GIO_ABI_VERSION; }

/* The image encoding as host C compiles it, compared with the Rust mirror by tests. */
void gio_abi_check_encode(gio_u64 *w, gio_u64 ticket, uint32_t ring_size) {
  gio_entry_encode(w, ticket, ring_size);
}
int gio_abi_check_decode(gio_u64 *w, gio_u64 ticket, uint32_t ring_size) {
  return gio_entry_decode(w, ticket, ring_size);
}

/* The mlx5 handler's structs: their static asserts, for host C. */
#include "gpunetio/gio_mlx5.cuh"
