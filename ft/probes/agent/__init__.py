"""The stack agent: this folder goes first on a target's PYTHONPATH (see sitecustomize.py)."""
