"""System checks for the REDLOCK setting (ids documented in docs/checks.rst)."""
