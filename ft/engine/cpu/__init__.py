"""The CPU MoE pool: pinned worker threads that compute routed experts for hybrid."""
