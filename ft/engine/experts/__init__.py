"""Routed experts: the host store, the device expert cache, and batched dispatch."""
