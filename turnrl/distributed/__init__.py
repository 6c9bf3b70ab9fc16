"""Scale-out on Ray: env workers as actors. Ray is imported only when these are used.

``RayEnvConfig`` is always importable (configs use it); ``RayEnvPool``, ``RayEnvFactory``,
``RemoteEnv`` and ``ray_env_factory`` import Ray on first access (``pip install 'turnrl[ray]'``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from turnrl.distributed.config import RayEnvConfig

if TYPE_CHECKING:
    from turnrl.distributed.ray_envs import RayEnvFactory, RayEnvPool, RemoteEnv, ray_env_factory

_NEED_RAY = ("RayEnvFactory", "RayEnvPool", "RemoteEnv", "ray_env_factory")


def __getattr__(name: str) -> Any:
    """Import the Ray-backed names on first use."""
    if name in _NEED_RAY:
        from turnrl.distributed import ray_envs

        return getattr(ray_envs, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["RayEnvConfig", "RayEnvFactory", "RayEnvPool", "RemoteEnv", "ray_env_factory"]
