"""freetoken: diagnose and bisect MoE decode slowdowns, around a reference MoE engine."""

__version__ = "0.1.0"
