/* Input of the `ibverbs-sys` bindings: the whole public API of libibverbs. */
#include <infiniband/verbs.h>
