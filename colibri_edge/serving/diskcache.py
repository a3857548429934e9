"""`colibri serve --cache-dir DIR`: conversations' KV prefixes kept on disk across restarts.

After a request ends, the whole KV blocks of its prompt and reply still in the engine's prefix cache
are saved as a session file (requests/session.py) in DIR/<model>/, named by the prefix hash of its
last block, with a hard link named by each earlier block's hash (no copy): the next turn's prompt
usually re-tokenises the end of the reply differently, so it matches the saved blocks up to some
earlier block, and finds them by that block's name. Before a request is submitted, when the engine's
cache does not already hold its prompt's whole blocks, the file of the longest prefix on disk is
loaded into the cache first (its blocks past the match too: they stay idle). So a server restarted
with the same DIR answers a conversation's next turn from the saved prefix. The folder is bounded
(`max_bytes`, each file counted once whatever its links): past it the least recently used files go,
with all their names. A file that cannot be loaded (another model, damaged) is removed and the
request prefills as usual. A model with recurrent layers (Qwen3.5) resumes only at a snapshot: its
files, one at the prompt's snapshot and one at the reply's when that differs, are named by the hash
of the block their snapshot closes, without links.
"""
from __future__ import annotations

import logging
import os
import re

from ..errors import ColibriError
from ..runtime.state import block_hashes

log = logging.getLogger("colibri.serve")


class DiskCache:
    def __init__(self, root: str, name: str, engine, max_bytes: int):
        self.dir = os.path.join(root, re.sub(r"[^A-Za-z0-9._-]", "_", name))
        os.makedirs(self.dir, exist_ok=True)
        self.engine, self.max_bytes = engine, int(max_bytes)

    def _path(self, h: bytes) -> str:
        return os.path.join(self.dir, h.hex() + ".session")

    def restore(self, ids) -> int:
        """Load the longest saved prefix of `ids` the engine's cache lacks; -> positions loaded (0: none).
        Runs in a worker thread (the load itself waits for the core, between steps)."""
        states = self.engine.runner.states
        B = states.prefix_block
        if not B or len(ids) <= B:
            return 0
        hashes = block_hashes(ids, B, upto=(len(ids) - 1) // B)
        have = states.longest_prefix(hashes)
        for j in range(len(hashes) - 1, have - 1, -1):
            path = self._path(hashes[j])
            if not os.path.exists(path):
                continue
            try:
                n = self.engine.load_session(path)
                os.utime(path)                                  # recently used
                return n
            except ColibriError as e:
                log.warning("cache-dir: %s not loaded (%s); removed", path, e.message)
                try:
                    os.remove(path)
                except OSError:
                    pass
        return 0

    def store(self, ids, prompt_len: int | None = None) -> str | None:
        """Save the cached whole blocks of `ids` (a finished request's prompt + reply); -> the file.
        A model with recurrent layers resumes only at a snapshot, the one a session file carries, so
        its files get no links; when the prompt's own snapshot (prompt_len) is not the file's, a
        second file ends there: the next turn, whose prompt may re-tokenise the reply, finds that one."""
        states = self.engine.runner.states
        B = states.prefix_block
        if not B or len(ids) < B:
            return None
        hashes = block_hashes(ids, B)
        n = states.longest_prefix(hashes)
        if n == 0:
            return None
        path = self._save(ids, hashes, n, links=not states.fixed)
        if states.fixed and prompt_len is not None:
            m = states.longest_prefix(hashes[:max(0, prompt_len - 1) // B])
            if 0 < m < n:
                self._save(ids, hashes, m, links=False)
        self.trim()
        return path

    def _save(self, ids, hashes, n, links: bool) -> str | None:
        B = self.engine.runner.states.prefix_block
        path = self._path(hashes[n - 1])
        if os.path.exists(path):
            os.utime(path)
            return path
        try:
            self.engine.save_session(list(ids[:n * B]), path)
        except ColibriError as e:                               # evicted meanwhile: nothing to keep
            log.warning("cache-dir: not saved (%s)", e.message)
            return None
        for h in hashes[:n - 1] if links else ():               # every shorter prefix finds it too
            link = self._path(h)
            try:
                if os.path.exists(link):
                    os.remove(link)                             # the longer conversation's file wins
                os.link(path, link)
            except OSError:
                pass
        return path

    def trim(self):
        """The least recently used files go until the folder holds at most max_bytes."""
        files = {}                                              # inode -> [latest mtime, size, names]
        for f in os.listdir(self.dir):
            if f.endswith(".session"):
                p = os.path.join(self.dir, f)
                try:
                    st = os.stat(p)
                except OSError:
                    continue
                e = files.setdefault(st.st_ino, [st.st_mtime, st.st_size, []])
                e[0] = max(e[0], st.st_mtime)
                e[2].append(p)
        total = sum(size for _, size, _ in files.values())
        for _, size, names in sorted(files.values()):
            if total <= self.max_bytes:
                break
            for p in names:
                try:
                    os.remove(p)
                except OSError:
                    pass
            total -= size
