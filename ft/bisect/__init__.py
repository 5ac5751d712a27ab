"""The performance bisect driver: which commit made a measured figure worse, with statistics.

driver.py    one run: check the input, set up, search, report (the CLI calls this)
config.py    the search's settings
gitrepo.py   the user's repository (read only), a scratch clone, clean worktrees, patch stack
judge.py     the swappable judge protocol and `--run CMD` (RunCommandJudge)
engine_judge.py, envs.py  engine mode: a commit's `ft serve`, environments per dependency set
measure.py   worker slots, their environment (CUDA_VISIBLE_DEVICES), taking samples
stats.py     rank tests, verdicts against both endpoints, effect size with a CI
store.py     every sample on disk as soon as it is taken, keyed by commit/stack/config
search.py    endpoints first, the range cut N+1 ways, the culprit confirmed
report.py    report.json (versioned), report.md (an issue comment), plot.png
verdict.py   the fixed verdicts and their one mapping to exit codes
"""
