/* The static inlines of verbs.h that pass `sizeof(*attr)` to the library, with the size
 * passed in instead: Rust passes the size of the struct it was generated with, so a
 * build against newer headers (larger structs) never lets the library write past it.
 * Same logic as rdma-core's ___ibv_query_port and ibv_query_device_ex. */
#include <errno.h>
#include <string.h>
#include "wrapper.h"

int ibverbs_sys_query_port(struct ibv_context *context, uint8_t port_num,
                           struct ibv_port_attr *port_attr, size_t port_attr_size)
{
	struct verbs_context *vctx = verbs_get_ctx_op(context, query_port);

	if (!vctx) {
		/* The compat struct is the oldest layout, a prefix of every ibv_port_attr
		 * the committed bindings describe. */
		memset(port_attr, 0, port_attr_size);
		/* Parenthesised: the exported compat symbol, not the header's macro. */
		return (ibv_query_port)(context, port_num,
					(struct _compat_ibv_port_attr *)port_attr);
	}
	return vctx->query_port(context, port_num, port_attr, port_attr_size);
}

int ibverbs_sys_query_device_ex(struct ibv_context *context,
                                const struct ibv_query_device_ex_input *input,
                                struct ibv_device_attr_ex *attr, size_t attr_size)
{
	struct verbs_context *vctx;
	int ret;

	if (input && input->comp_mask)
		return EINVAL;
	vctx = verbs_get_ctx_op(context, query_device_ex);
	if (vctx) {
		ret = vctx->query_device_ex(context, input, attr, attr_size);
		if (ret != EOPNOTSUPP && ret != ENOSYS)
			return ret;
	}
	memset(attr, 0, attr_size);
	return ibv_query_device(context, &attr->orig_attr);
}
