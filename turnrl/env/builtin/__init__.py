"""Ready-made envs, each registered by name in ``turnrl.env.registry`` and imported only when used.

- ``math_tools``: reasoning-gym math with a calculator tool, scored by the task's own verifier.
- ``guess_number``: guess a secret number with higher / lower hints (multi-turn, no dependencies).
- ``textarena``: any single-player textarena game, observations reduced to what is new.
- ``swift_scheduler``: ms-swift's scheduler style (``check_finished`` / ``step``) as an env, with a port
  of its thinking-tips scheduler.
- ``tool_env``: tools from a verl-style YAML, chosen per row, with a verl-style reward tool.
- ``frozen_lake``: gymnasium's FrozenLake-v1 for vision-language models, the board shown as an image
  each turn.
- ``zoom``: read a tiny code in a grid image with a ``zoom`` tool that returns an enlarged crop (images in
  tool results).
"""
