"""``nixl.logging`` is ``rdma_nixl.logging``: importing this module replaces it with that one."""

import sys

from rdma_nixl import logging as _target

sys.modules[__name__] = _target
