"""The fault suite: the production topology as separate processes, broken on purpose (see harness.py)."""
