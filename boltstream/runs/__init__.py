"""Whole runs: ``boltstream train`` and ``boltstream demo`` start every component as a process;
``boltstream evaluate`` scores a base model and a checkpoint on held-out tasks.

Nothing here trains or serves; it only starts, watches and stops the components, so a run
behaves exactly as the same components started by hand or by docker compose.
"""
