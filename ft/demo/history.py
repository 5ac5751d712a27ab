"""The demo's scratch repository: the installed `ft` source, copied, with a short history.

    v0.1.2 -- README -- comment -- log wording -- PLANTED -- comment -- comment -- description

Built under the demo's out dir with git's user and system configuration switched off (no
hooks, no signing, no identity needed) and every GIT_* variable of the caller ignored, so no
repository of the user's is ever read or written.
"""

from __future__ import annotations

import importlib.metadata as md
import shutil
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import git

import ft
from ft.demo.edits import AFTER, AUTHORS, BEFORE, PLANTED, Commit
from ft.errors import FtError

GOOD_TAG = "v0.1.2"  # the seed report's last good release
_START = datetime(2026, 10, 5, 9, 30, tzinfo=timezone.utc)
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo", "*.egg-info")
_GITIGNORE = "__pycache__/\n*.pyc\n"


@dataclass(frozen=True)
class ScratchHistory:
    repo: Path
    good_sha: str  # GOOD_TAG
    planted_sha: str
    planted_subject: str
    head_sha: str
    commits: int  # after the tag

    @property
    def range(self) -> str:
        return f"{GOOD_TAG}..{self.head_sha[:12]}"


def git_env() -> dict[str, str | None]:
    """Variables for every git call: nothing from the user's git configuration or session."""
    return {
        "GIT_CONFIG_GLOBAL": "/dev/null",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_TERMINAL_PROMPT": "0",
    }


def build_history(dest: Path) -> ScratchHistory:
    """Copy the source into `dest` (new), commit the release, tag it, then the scripted commits."""
    copy_source(dest)
    try:
        return _commit_all(git.Repo.init(dest), dest)
    except git.GitCommandError as exc:
        why = (exc.stderr or str(exc)).strip().splitlines()
        raise FtError(f"git failed while building the scratch history: {why[-1]}") from None


def _commit_all(repo: git.Repo, dest: Path) -> ScratchHistory:
    with repo.config_writer() as cfg:  # the tag's identity; commits name their own authors
        cfg.set_value("user", "name", "ft demo")
        cfg.set_value("user", "email", "demo@example.com")
    (dest / ".gitignore").write_text(_GITIGNORE)
    good = _commit(repo, Commit(f"Release {GOOD_TAG.removeprefix('v')}", "", 0, ()), 0)
    repo.create_tag(GOOD_TAG, ref=good, message=f"{GOOD_TAG}")
    planted = ""
    for k, c in enumerate((*BEFORE, PLANTED, *AFTER), start=1):
        for edit in c.edits:
            edit(dest)
        sha = _commit(repo, c, k)
        planted = sha if c.planted else planted
    head = repo.head.commit.hexsha
    count = len(BEFORE) + 1 + len(AFTER)
    return ScratchHistory(dest, good, planted, PLANTED.subject, head, count)


def _commit(repo: git.Repo, c: Commit, k: int) -> str:
    name, email = AUTHORS[c.author]
    when = (_START + timedelta(days=k, minutes=47 * k)).isoformat()
    env = {
        "GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email, "GIT_AUTHOR_DATE": when,
        "GIT_COMMITTER_NAME": name, "GIT_COMMITTER_EMAIL": email, "GIT_COMMITTER_DATE": when,
    }  # fmt: skip
    message = c.subject + (f"\n\n{c.body}" if c.body else "")
    repo.git.add("--all")
    repo.git.commit("--quiet", "--no-verify", "--allow-empty", "-m", message, env=env)
    return repo.head.commit.hexsha


def copy_source(dest: Path) -> None:
    """The `ft` package as installed, plus pyproject.toml and README.md (rebuilt from the
    installed metadata where the install is not a checkout)."""
    package = Path(ft.__file__).resolve().parent
    if dest.exists() and any(dest.iterdir()):
        raise FtError(f"{dest} is not empty")
    shutil.copytree(package, dest / "ft", ignore=_IGNORE)
    root = package.parent
    if _is_ft_project(root / "pyproject.toml"):
        shutil.copyfile(root / "pyproject.toml", dest / "pyproject.toml")
    else:
        (dest / "pyproject.toml").write_text(_pyproject_from_metadata())
    readme = root / "README.md"
    text = readme.read_text() if readme.is_file() else "# freetoken (`ft`)\n"
    (dest / "README.md").write_text(text)


def _is_ft_project(path: Path) -> bool:
    return path.is_file() and 'name = "freetoken"' in path.read_text()


def _pyproject_from_metadata() -> str:
    """A pyproject.toml with the installed distribution's name, version and dependencies."""
    try:
        meta = md.metadata("freetoken")
        requires = [r for r in md.requires("freetoken") or [] if "extra ==" not in r]
    except md.PackageNotFoundError:
        meta, requires = {"Version": ft.__version__}, []
    deps = "".join(f'    "{r}",\n' for r in requires)
    return (
        '[project]\nname = "freetoken"\n'
        f'version = "{meta["Version"]}"\n'
        'description = "Diagnose and bisect MoE decode slowdowns"\n'
        f"dependencies = [\n{deps}]\n"
    )
