"""A module that prints when it is imported (a fork server's protocol must not hear it)."""

print("noisy_module imported")
