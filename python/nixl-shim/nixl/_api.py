"""``nixl._api`` is ``rdma_nixl._api``: importing this module replaces it with that one."""

import sys

from rdma_nixl import _api as _target

sys.modules[__name__] = _target
