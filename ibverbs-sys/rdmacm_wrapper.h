/* Input of the `ibverbs-sys` rdma_cm bindings (feature `rdmacm`). */
#include <rdma/rdma_cma.h>
#include <rdma/rdma_verbs.h>
