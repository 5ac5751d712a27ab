"""`ft demo`: the seed report's story end to end on a scratch copy of ft (see run.py)."""
