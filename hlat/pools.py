"""The work pools `hlat deploy` and `hlat worker` serve: the default pool's name and the pool types.

Its own module so that the CLI's parser names them without importing the deployment tooling.
"""

from __future__ import annotations

DEFAULT_POOL = "hlat"
POOL_TYPES = ("process", "ecs", "kubernetes")
