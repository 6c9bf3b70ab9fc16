"""The application layer: configs into engines, env factories, samples and rollout specs.

The only part that knows every other part; ``cli``, ``train`` and ``integrations`` build on it.
"""

from turnrl.app.engines import (
    EngineBuild,
    EngineSetupError,
    build_engine,
    hf_engine,
    local_engine,
    server_engine,
)
from turnrl.app.parts import RunError, build_env_factory, build_rewards, build_spec, load_samples
from turnrl.app.run import Prepared, prepare, run, run_prepared

__all__ = [
    "EngineBuild",
    "EngineSetupError",
    "Prepared",
    "RunError",
    "build_engine",
    "build_env_factory",
    "build_rewards",
    "build_spec",
    "hf_engine",
    "load_samples",
    "local_engine",
    "prepare",
    "run",
    "run_prepared",
    "server_engine",
]
