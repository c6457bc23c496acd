/*
 * The headers bound by libfabric-sys: the whole public API of libfabric.
 * Only headers present in every supported release (1.17 up to 2.x) are listed.
 * The generated shim (src/generated/wrap_static.c) includes this file by
 * relative name; build.rs compiles it with -I<crate dir>.
 */
#include <rdma/fabric.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_tagged.h>
#include <rdma/fi_atomic.h>
#include <rdma/fi_trigger.h>
#include <rdma/fi_collective.h>
#include <rdma/fi_ext.h>
