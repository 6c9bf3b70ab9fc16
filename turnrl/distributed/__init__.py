"""Scale-out on Ray: env workers and engines as actors. Ray is imported only when these are used.

``RayEnvConfig`` and ``RayEngineConfig`` are always importable (configs use them); the other
names import Ray on first access (``pip install 'turnrl[ray]'``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from turnrl.config import RayEngineConfig, RayEnvConfig

if TYPE_CHECKING:
    from turnrl.distributed.ray_engines import (
        RayEngine,
        get_registry,
        register_actor,
        register_server,
        start_engine_actor,
    )
    from turnrl.distributed.ray_envs import RayEnvFactory, RayEnvPool, RemoteEnv, ray_env_factory
    from turnrl.distributed.registry_engine import RegistryEngine

_NEED_RAY = {
    "RayEnvFactory": "ray_envs",
    "RayEnvPool": "ray_envs",
    "RemoteEnv": "ray_envs",
    "ray_env_factory": "ray_envs",
    "RayEngine": "ray_engines",
    "RegistryEngine": "registry_engine",
    "get_registry": "ray_engines",
    "register_actor": "ray_engines",
    "register_server": "ray_engines",
    "start_engine_actor": "ray_engines",
}


def __getattr__(name: str) -> Any:
    """Import the Ray-backed names on first use."""
    if name in _NEED_RAY:
        import importlib

        return getattr(importlib.import_module(f"turnrl.distributed.{_NEED_RAY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "RayEngine",
    "RayEngineConfig",
    "RayEnvConfig",
    "RayEnvFactory",
    "RayEnvPool",
    "RegistryEngine",
    "RemoteEnv",
    "get_registry",
    "ray_env_factory",
    "register_actor",
    "register_server",
    "start_engine_actor",
]
