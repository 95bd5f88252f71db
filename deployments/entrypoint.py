"""The deployment's entrypoint (``deployments/entrypoint.py:rlhf``).

Prefect loads an entrypoint file as a script module of its own name; tasks defined in such a
module cannot be unpickled by Ray workers. Importing the flow from its package keeps every task
importable as ``flows.rlhf.*``.
"""

from flows.rlhf import rlhf

__all__ = ["rlhf"]
