"""The performance bisect driver: which commit made a measured figure worse, with statistics.

gitrepo.py   the user's repository (read only), a scratch clone, clean worktrees, patch stack
judge.py     the swappable judge protocol and `--run CMD` (RunCommandJudge)
engine_judge.py  engine mode: install a commit, start its `ft serve`, run the workload
stats.py     rank tests, verdicts against both endpoints, effect size with a CI
store.py     every sample on disk as soon as it is taken, keyed by commit/stack/config
search.py    endpoints first, the range cut N+1 ways, the culprit confirmed
report.py    report.json (versioned), report.md (an issue comment), plot.png
"""
