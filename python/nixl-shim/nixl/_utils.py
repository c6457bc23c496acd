"""``nixl._utils`` is ``rdma_nixl._utils``: importing this module replaces it with that one."""

import sys

from rdma_nixl import _utils as _target

sys.modules[__name__] = _target
