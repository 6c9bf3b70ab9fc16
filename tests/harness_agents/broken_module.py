"""A module that fails when it is imported."""

raise RuntimeError("broken on purpose")
