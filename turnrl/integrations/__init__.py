"""Trainer integrations. Each lives in its own module and imports its trainer only when used."""
