"""Executors: where train workers and rollout engines run (``--executor``)."""
