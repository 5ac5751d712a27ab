"""Git, through GitPython. The user's repository is only ever read: every checkout happens in a
scratch clone under the out dir (sharing the user's objects), one clean worktree per worker."""

from __future__ import annotations

import hashlib
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import git

from ft.bisect.verdict import Skip
from ft.errors import FtError


@dataclass(frozen=True)
class CommitInfo:
    sha: str
    subject: str
    author: str
    date: str  # ISO 8601, the author date

    @property
    def short(self) -> str:
        return self.sha[:10]


class UserRepo:
    """The repository named by --repo: revisions resolved, the range listed, nothing written."""

    def __init__(self, path: Path):
        try:
            self.repo = git.Repo(path, search_parent_directories=True)
        except (git.InvalidGitRepositoryError, git.NoSuchPathError):
            raise FtError(f"{path} is not a git repository") from None
        self.path = Path(self.repo.working_tree_dir or self.repo.git_dir)

    @staticmethod
    def clone_bundle(bundle: Path, dst: Path) -> None:
        """A bare repository made from a git bundle (a Ray node's copy of the range), every
        ref of the bundle kept (a clone would keep only its branches)."""
        repo = git.Repo.init(str(dst), bare=True)
        repo.git.fetch("--quiet", str(bundle), "refs/*:refs/*")

    def resolve(self, rev: str) -> str:
        try:
            return self.repo.git.rev_parse("--verify", "--quiet", f"{rev}^{{commit}}")
        except git.GitCommandError:
            raise FtError(f"unknown revision {rev!r} in {self.path}") from None

    def is_ancestor(self, older: str, newer: str) -> bool:
        return self.repo.is_ancestor(older, newer)

    def commits(self, good: str, bad: str) -> list[str]:
        """GOOD, the commits after it, BAD: oldest first, along BAD's first-parent line."""
        if good == bad:
            raise FtError(f"GOOD and BAD are the same commit ({good[:10]})")
        if not self.is_ancestor(good, bad):
            raise FtError(f"GOOD {good[:10]} is not an ancestor of BAD {bad[:10]}")
        line = self._rev_list("--first-parent", good, bad)
        if line and self.repo.commit(line[0]).parents[0].hexsha == good:
            return [good, *line]
        return [good, *self._rev_list("--topo-order", good, bad)]  # GOOD on a merged branch

    def _rev_list(self, order: str, good: str, bad: str) -> list[str]:
        return self.repo.git.rev_list(
            "--reverse", "--ancestry-path", order, f"{good}..{bad}"
        ).split()

    def info(self, sha: str) -> CommitInfo:
        c = self.repo.commit(sha)
        author = f"{c.author.name} <{c.author.email}>"
        return CommitInfo(sha, c.summary, author, c.authored_datetime.isoformat())

    def diffstat(self, sha: str) -> str:
        return self.repo.git.show("--stat", "--format=", sha).strip()

    def head_sha(self) -> str | None:
        try:
            return self.repo.head.commit.hexsha
        except ValueError:  # an unborn branch
            return None

    def dirty_files(self) -> list[str]:
        """Tracked files with uncommitted changes, staged or not (untracked files never matter)."""
        staged = [d.a_path for d in self.repo.index.diff("HEAD")] if self.head_sha() else []
        return sorted({*staged, *(d.a_path for d in self.repo.index.diff(None))})

    def refuse_dirty_endpoint(self, good: str, bad: str) -> None:
        """A dirty checkout matters only where the user may think its edits get measured: when
        an endpoint is the checked-out commit. The edits would not be: say so, change nothing."""
        head = self.head_sha()
        dirty = self.dirty_files() if head in (good, bad) else []
        if dirty:
            names = ", ".join(dirty[:3]) + (", ..." if len(dirty) > 3 else "")
            raise FtError(
                f"the checkout at {self.path} has uncommitted changes ({names}) and the range "
                f"ends at its HEAD {head[:10]}: they would not be measured; commit or stash them"
            )


@dataclass(frozen=True)
class PatchStack:
    """Applied on every tested commit: --pick REV (where missing), then --patch FILE, in order."""

    picks: tuple[str, ...] = ()  # full hashes
    patches: tuple[Path, ...] = ()  # copies under the out dir, so edits mid-run cannot leak in

    def digest(self) -> str:
        if not self.picks and not self.patches:
            return "none"
        h = hashlib.sha256()
        for sha in self.picks:
            h.update(b"pick " + sha.encode())
        for p in self.patches:
            h.update(b"patch " + p.read_bytes())
        return h.hexdigest()[:12]

    def describe(self) -> list[str]:
        return [f"pick {s[:10]}" for s in self.picks] + [f"patch {p.name}" for p in self.patches]


class Scratch:
    """A clone of the user's repository that shares its objects (git clone --shared), and the
    worker worktrees made from it. Nothing here writes to the user's repository."""

    def __init__(self, user: UserRepo, root: Path, base: str):
        self.root, self.base = root, base  # base: any commit of the range, for new worktrees
        self._worktrees = threading.Lock()
        clone_dir = root / "git"
        if (clone_dir / "HEAD").exists():
            self.clone = git.Repo(clone_dir)
        else:
            src = user.repo.git_dir if user.repo.bare else user.path
            self.clone = git.Repo.clone_from(str(src), clone_dir, shared=True, bare=True)

    def bundle(self, shas: list[str], path: Path) -> Path:
        """A git bundle holding these commits and their history: what a Ray node checks out.
        Refs of their own name them (a bundle carries refs, not bare hashes)."""
        refs = [f"refs/ft-bisect/{k}" for k in range(len(shas))]
        for ref, sha in zip(refs, shas, strict=True):
            self.clone.git.update_ref(ref, sha)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.clone.git.bundle("create", str(path), *refs)
        return path

    def worktree(self, slot: int | str) -> Path:
        path = self.root / "worktrees" / f"w{slot}"
        # one at a time (--jobs: a worker thread per slot): another slot's `prune` deletes the
        # admin folder of a worktree still being added, whose .git file is not written yet
        with self._worktrees:
            if not (path / ".git").exists():
                self.clone.git.worktree("prune")
                path.parent.mkdir(parents=True, exist_ok=True)
                self.clone.git.worktree("add", "--detach", "--force", str(path), self.base)
        return path

    def checkout(self, path: Path, sha: str, stack: PatchStack) -> Skip | list[str]:
        """A clean tree of `sha` with the stack applied; what was applied, or why it was not."""
        wt = git.Repo(path)
        wt.git.reset("--hard", "--quiet")
        wt.git.checkout("--force", "--detach", "--quiet", sha)
        wt.git.clean("-ffdxq")
        notes: list[str] = []
        for pick in stack.picks:
            note = _apply_pick(wt, pick, sha)
            if isinstance(note, Skip):
                return note
            notes.append(note)
        for patch in stack.patches:
            note = _apply_patch(wt, patch)
            if isinstance(note, Skip):
                return note
            notes.append(note)
        return notes


def _apply_pick(wt: git.Repo, pick: str, sha: str) -> Skip | str:
    """syzkaller's rule: a fix the commit already has is not applied again."""
    if wt.is_ancestor(pick, sha):
        return f"pick {pick[:10]} already in the commit"
    if _already_there(wt, wt.git.diff(f"{pick}^", pick, binary=True)):
        return f"pick {pick[:10]} already in the tree"
    try:
        wt.git.cherry_pick("--no-commit", pick)
    except git.GitCommandError as exc:
        return Skip(f"--pick {pick[:10]} does not apply: {_first_error_line(exc)}")
    return f"pick {pick[:10]} applied"


def _apply_patch(wt: git.Repo, patch: Path) -> Skip | str:
    if _already_there(wt, patch.read_text()):
        return f"patch {patch.name} already in the tree"
    try:
        wt.git.apply("--index", str(patch))
    except git.GitCommandError as exc:
        return Skip(f"--patch {patch.name} does not apply: {_first_error_line(exc)}")
    return f"patch {patch.name} applied"


def _already_there(wt: git.Repo, diff: str) -> bool:
    """The change is in the tree already (it reverses cleanly): a backport, a rebase."""
    try:
        wt.git.apply("--check", "--reverse", istream=_stdin(diff.rstrip("\n") + "\n"))
        return True
    except git.GitCommandError:
        return False


def _stdin(text: str):
    f = tempfile.TemporaryFile()
    f.write(text.encode())
    f.seek(0)
    return f


def _first_error_line(exc: git.GitCommandError) -> str:
    text = (exc.stderr or str(exc)).strip().replace("stderr: ", "").strip("' \n")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return (lines[0] if lines else "git failed")[:200]
