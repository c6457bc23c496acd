"""``nixl._bindings`` is ``rdma_nixl._bindings``: importing this module replaces it with that one."""

import sys

from rdma_nixl import _bindings as _target

sys.modules[__name__] = _target
