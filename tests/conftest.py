"""Test-run-wide fixtures. Part-specific fixtures live in each tests/<part>/conftest.py."""
