"""Envs of other libraries as turnrl envs, each registered by name in ``turnrl.env.registry`` and
imported only when used: ``gymnasium``, ``textarena``, ``skyrl_gym`` and ``openenv``."""
