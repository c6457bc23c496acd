/* Input of the `mlx5dv-sys` bindings: libmlx5 direct verbs (mlx5dv, DEVX, WQE segments). */
#include <infiniband/mlx5dv.h>
