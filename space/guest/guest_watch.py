"""Directory watchers (``watch.*``): inotify through ctypes, one reader thread for every watcher.

The control plane is stateless, so a watcher lives here: it buffers events until someone polls
(E2B's CreateWatcher / GetWatcherEvents / RemoveWatcher), and is dropped when nobody polled it for
IDLE seconds (clients die without removing their watchers).

Event semantics follow E2B's envd (fsnotify's inotify backend):
- IN_CREATE, IN_MOVED_TO -> ``create`` (a file moved in is a create);
- IN_MOVED_FROM, IN_MOVE_SELF -> ``rename`` (a file moved out is a rename, not a remove);
- IN_MODIFY -> ``write`` (not IN_CLOSE_WRITE: a ``touch`` is no write);
- IN_DELETE, IN_DELETE_SELF -> ``remove``; IN_ATTRIB -> ``chmod``.
``name`` is the path relative to the watched directory (``.`` for the directory itself). A recursive
watcher watches every subdirectory, existing or new; for a directory created or moved into the tree
it also reports ``create`` for everything already inside it ("mkdir -p a/b/c", moved-in trees),
since that happened before its watch existed (duplicates are possible, losses are not).

Each watcher owns one inotify fd (wds are per fd, so watchers never share or unwatch each other's
watches). After registration only the reader thread touches a watcher's fd and wd maps: the
requests hand it new and removed watchers through lists under the lock, so an fd is never closed
under a read. The lock guards those lists and each watcher's event buffer.

Checkpoint/restore: gVisor saves inotify instances with the sandbox (tests/e2e/test_watch.py: after
a fork and after a suspend/restore, watchers opened before the checkpoint keep reporting, recursive
ones included), so nothing is re-armed here.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from collections import deque

if __package__:
    from . import protocol
    from .guest_base import GuestError, arg, close_fd, log, norm_path, os_error, poke
    from .guest_files import file_entry
else:  # top-level inside the sandbox: daemon.py put this directory on sys.path
    import protocol  # type: ignore[no-redef, import-not-found]
    from guest_base import GuestError, arg, close_fd, log, norm_path, os_error, poke  # type: ignore[no-redef, import-not-found]
    from guest_files import file_entry  # type: ignore[no-redef, import-not-found]

TYPE_CHECKING = False  # type checkers read it as true; importing typing costs boot time (see daemon.py)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from .daemon import Daemon
    from .guest_base import Header

MAX_WATCHERS = 64
#: Events a watcher buffers between polls; past it the oldest go and the next poll says ``overflowed``.
MAX_EVENTS = int(os.environ.get("SPACE_GUEST_WATCH_MAX_EVENTS", "10000"))
#: Directories one recursive watcher may watch (each is an inotify watch).
MAX_DIRS = 16384
#: Seconds without a poll after which a watcher is dropped.
IDLE = float(os.environ.get("SPACE_GUEST_WATCH_IDLE", "600"))

IN_MODIFY = 0x2
IN_ATTRIB = 0x4
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x1000000
IN_DONT_FOLLOW = 0x2000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
MASK = (IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF
        | IN_MOVE_SELF)
#: (inotify bits, event type), in E2B's order for an event that carries several.
TYPES = ((IN_CREATE | IN_MOVED_TO, "create"), (IN_MOVED_FROM | IN_MOVE_SELF, "rename"),
         (IN_ATTRIB, "chmod"), (IN_MODIFY, "write"), (IN_DELETE | IN_DELETE_SELF, "remove"))
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len; then len bytes of name
_HEADER = _EVENT.size


class _Libc:
    """The three inotify calls, through ctypes (imported on the first watcher, not at boot)."""

    def __init__(self) -> None:
        try:
            import ctypes
        except ImportError:
            raise GuestError("runtime_error", "directory watching needs ctypes in the sandbox's python3") from None
        self.ctypes = ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        self._init = libc.inotify_init1
        self._init.argtypes = [ctypes.c_int]
        self._init.restype = ctypes.c_int
        self._add = libc.inotify_add_watch
        self._add.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        self._add.restype = ctypes.c_int
        self._rm = libc.inotify_rm_watch
        self._rm.argtypes = [ctypes.c_int, ctypes.c_int]
        self._rm.restype = ctypes.c_int

    def _fail(self, path: str = "") -> OSError:
        err = self.ctypes.get_errno()
        return OSError(err, os.strerror(err), path) if path else OSError(err, os.strerror(err))

    def init(self) -> int:
        fd = int(self._init(IN_NONBLOCK | IN_CLOEXEC))
        if fd < 0:
            raise self._fail()
        return fd

    def add_watch(self, fd: int, path: str, mask: int) -> int:
        wd = int(self._add(fd, os.fsencode(path), mask))
        if wd < 0:
            raise self._fail(path)
        return wd

    def rm_watch(self, fd: int, wd: int) -> None:
        self._rm(fd, wd)  # EINVAL when the kernel dropped it already: nothing to do


def _limit_error(exc: OSError, what: str) -> GuestError:
    import errno

    if exc.errno in (errno.ENOSPC, errno.EMFILE, errno.ENFILE):
        return GuestError("quota_exceeded", f"{what}: {exc.strerror}")
    return os_error(exc)


class Watcher:
    """One watched directory: its inotify fd, its watches and the events nobody polled yet."""

    def __init__(self, wid: str, root: str, recursive: bool, entry: bool, fd: int) -> None:
        self.id = wid
        self.root = root
        self.recursive = recursive
        self.entry = entry
        self.fd = fd
        self.dirs: dict[int, str] = {}  # wd -> directory relative to root ("" for root)
        self.wds: dict[str, int] = {}  # the reverse
        self.events: deque[Header] = deque()
        self.overflowed = False  # events were lost since the last poll (under the hub's lock)
        self.lost = False  # the reader lost some in the batch it is reading (reader thread only)
        self.last_poll = time.monotonic()
        self.created_at = time.time()

    def full_path(self, rel: str) -> str:
        return self.root if not rel or rel == "." else (self.root.rstrip("/") + "/" + rel)


class Hub(threading.Thread):
    """Every watcher of the daemon and the one thread that reads their inotify fds (epoll)."""

    def __init__(self) -> None:
        super().__init__(name="watch", daemon=True)
        import select

        self.libc = _Libc()
        self.lock = threading.Lock()
        self.watchers: dict[str, Watcher] = {}
        self.incoming: list[Watcher] = []
        self.closing: list[Watcher] = []
        self.by_fd: dict[int, Watcher] = {}  # reader thread only
        self.ep = select.epoll()
        self._in = select.EPOLLIN
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.ep.register(self.wake_r, self._in)

    # -- requests (any thread) ---------------------------------------------------------------

    def add(self, root: str, recursive: bool, entry: bool) -> Watcher:
        with self.lock:
            if len(self.watchers) >= MAX_WATCHERS:
                raise GuestError("quota_exceeded", f"at most {MAX_WATCHERS} watchers per sandbox")
        try:
            fd = self.libc.init()
        except OSError as exc:
            raise _limit_error(exc, "no inotify instance left") from None
        w = Watcher("w" + os.urandom(8).hex(), root, recursive, entry, fd)
        try:
            # The fd is ours until it is handed over: no lock needed for the first watches.
            try:
                self._watch(w, "", IN_ONLYDIR, strict=True)
            except OSError as exc:
                raise _limit_error(exc, f"cannot watch {root}") from None
            if recursive:
                self._walk(w, "", emit=None)
        except BaseException:
            close_fd(fd)
            raise
        with self.lock:
            if len(self.watchers) >= MAX_WATCHERS:
                close_fd(fd)
                raise GuestError("quota_exceeded", f"at most {MAX_WATCHERS} watchers per sandbox")
            self.watchers[w.id] = w
            self.incoming.append(w)
        self.wake()
        return w

    def poll(self, wid: str, limit: int) -> tuple[list[Header], bool, int]:
        with self.lock:
            w = self._get(wid)
            w.last_poll = time.monotonic()
            n = min(limit, len(w.events))
            out = [w.events.popleft() for _ in range(n)]
            overflowed = w.overflowed
            w.overflowed = False
            return out, overflowed, len(w.events)

    def remove(self, wid: str) -> None:
        with self.lock:
            self.closing.append(self._get(wid))
            del self.watchers[wid]
        self.wake()

    def describe(self) -> list[Header]:
        now = time.monotonic()
        with self.lock:
            return [{"id": w.id, "path": w.root, "recursive": w.recursive, "dirs": len(w.dirs),
                     "buffered": len(w.events), "overflowed": w.overflowed, "idle": round(now - w.last_poll, 3),
                     "created_at": w.created_at} for w in self.watchers.values()]

    def _get(self, wid: str) -> Watcher:
        w = self.watchers.get(wid)
        if w is None:
            raise GuestError("not_found", f"watcher {wid} not found")
        return w

    def wake(self) -> None:
        poke(self.wake_w)

    # -- the reader thread --------------------------------------------------------------------

    def run(self) -> None:
        sweep = min(60.0, max(0.05, IDLE / 4))
        while True:
            try:
                ready = self.ep.poll(sweep)
            except InterruptedError:
                continue
            try:
                self._maintain()
                for fd, _ in ready:
                    if fd == self.wake_r:
                        self._drain_wake()
                        continue
                    w = self.by_fd.get(fd)
                    if w is not None:
                        self._read(w)
            except Exception as exc:  # the reader must survive anything one watcher does
                log(f"watch reader: {exc!r}")

    def _drain_wake(self) -> None:
        try:
            while os.read(self.wake_r, 4096):
                pass
        except OSError:
            pass

    def _maintain(self) -> None:
        now = time.monotonic()
        with self.lock:
            incoming, self.incoming = self.incoming, []
            for w in list(self.watchers.values()):
                if now - w.last_poll > IDLE:
                    del self.watchers[w.id]
                    self.closing.append(w)
            closing, self.closing = self.closing, []
        for w in incoming:
            self.by_fd[w.fd] = w
            self.ep.register(w.fd, self._in)
        for w in closing:
            if self.by_fd.pop(w.fd, None) is w:
                self.ep.unregister(w.fd)
            close_fd(w.fd)
            w.fd = -1

    def _read(self, w: Watcher) -> None:
        # A bounded turn per wakeup: a directory written to without pause must not starve the others
        # (epoll is level-triggered: the rest is read on the next turn).
        for _ in range(16):
            try:
                buf = os.read(w.fd, 1 << 16)
            except BlockingIOError:
                return
            if not buf:
                return
            events: list[Header] = []
            self._parse(w, buf, events)
            if events or w.lost:
                self._push(w, events)

    def _parse(self, w: Watcher, buf: bytes, out: list[Header]) -> None:
        off = 0
        while off + _HEADER <= len(buf):
            wd, mask, _cookie, n = _EVENT.unpack_from(buf, off)
            raw = buf[off + _HEADER : off + _HEADER + n].rstrip(b"\x00")
            off += _HEADER + n
            if mask & IN_Q_OVERFLOW:
                w.lost = True  # the kernel queue lost events: so did we
                continue
            rel_dir = w.dirs.get(wd)
            if rel_dir is None:
                continue  # a watch we dropped (a directory moved away) still had events queued
            if mask & IN_IGNORED:
                self._forget(w, wd)
                continue
            name = os.fsdecode(raw)
            if name:
                rel = f"{rel_dir}/{name}" if rel_dir else name
            elif rel_dir:
                continue  # a subdirectory's own event: its parent's watch reports it by name
            else:
                rel = "."
            self._emit(w, rel, mask, out)
            if w.recursive and name and mask & IN_ISDIR:
                if mask & IN_MOVED_FROM:
                    self._unwatch_tree(w, rel)  # re-watched if it lands inside (IN_MOVED_TO)
                elif mask & IN_DELETE:
                    self._drop_tree(w, rel)
                if mask & (IN_CREATE | IN_MOVED_TO):
                    try:
                        if not self._watch(w, rel, IN_ONLYDIR | IN_DONT_FOLLOW):
                            continue
                    except OSError:
                        continue  # gone again already
                    self._walk(w, rel, emit=out)

    def _emit(self, w: Watcher, rel: str, mask: int, out: list[Header]) -> None:
        ts = time.time()
        entry: Header | None = None
        if w.entry:
            try:
                entry = file_entry(w.full_path(rel))
            except OSError:
                entry = None
        for bits, kind in TYPES:
            if mask & bits:
                ev: Header = {"name": rel, "type": kind, "ts": ts}
                if w.entry:
                    ev["entry"] = entry
                out.append(ev)

    def _push(self, w: Watcher, events: list[Header]) -> None:
        with self.lock:
            if w.lost:
                w.overflowed = True
                w.lost = False
            for ev in events:
                if len(w.events) >= MAX_EVENTS:
                    w.events.popleft()
                    w.overflowed = True
                w.events.append(ev)

    # -- watches (the reader thread, or the adding thread before hand-over) --------------------

    def _watch(self, w: Watcher, rel: str, flags: int, strict: bool = False) -> bool:
        """Watch directory ``rel``; False past MAX_DIRS (``strict``: refuse the watcher instead)."""
        if len(w.dirs) >= MAX_DIRS:
            if strict:
                raise GuestError("quota_exceeded", f"{w.root} has more than {MAX_DIRS} directories to watch")
            w.lost = True  # its events will be missing
            return False
        wd = self.libc.add_watch(w.fd, w.full_path(rel), MASK | flags)
        w.dirs[wd] = rel
        w.wds[rel] = wd
        return True

    def _walk(self, w: Watcher, rel: str, emit: list[Header] | None) -> None:
        """Watch every directory under ``rel``; with ``emit``, report everything found as created."""
        stack = [rel]
        while stack:
            here = stack.pop()
            try:
                with os.scandir(w.full_path(here)) as it:
                    entries = list(it)
            except OSError:
                continue  # unreadable or already gone: nothing to watch there
            for e in entries:
                child = f"{here}/{e.name}" if here else e.name
                try:
                    is_dir = e.is_dir(follow_symlinks=False)
                except OSError:
                    continue
                if emit is not None:
                    self._emit(w, child, IN_CREATE, emit)
                if not is_dir:
                    continue
                try:
                    if self._watch(w, child, IN_ONLYDIR | IN_DONT_FOLLOW, strict=emit is None):
                        stack.append(child)
                except OSError as exc:
                    import errno

                    if emit is None and exc.errno == errno.ENOSPC:
                        raise _limit_error(exc, f"cannot watch {w.full_path(child)}") from None
                    # unreadable, gone already, or (while running) out of watches: not watched
                    w.lost = w.lost or exc.errno == errno.ENOSPC

    def _forget(self, w: Watcher, wd: int) -> None:
        rel = w.dirs.pop(wd, None)
        if rel is not None and w.wds.get(rel) == wd:
            del w.wds[rel]

    def _subtree(self, w: Watcher, rel: str) -> list[int]:
        prefix = rel + "/"
        return [wd for r, wd in w.wds.items() if r == rel or r.startswith(prefix)]

    def _unwatch_tree(self, w: Watcher, rel: str) -> None:
        for wd in self._subtree(w, rel):
            self._forget(w, wd)
            self.libc.rm_watch(w.fd, wd)

    def _drop_tree(self, w: Watcher, rel: str) -> None:
        for wd in self._subtree(w, rel):
            self._forget(w, wd)  # the kernel drops deleted directories' watches itself


_hub: list[Hub] = []
_hub_lock = threading.Lock()


def hub() -> Hub:
    """The daemon's watcher hub, made (and its thread started) by the first watcher."""
    with _hub_lock:
        if not _hub:
            h = Hub()
            h.start()
            _hub.append(h)
        return _hub[0]


def _existing() -> Hub | None:
    with _hub_lock:
        return _hub[0] if _hub else None


# ---------------------------------------------------------------------------------------- ops


def op_watch_add(d: Daemon, rid: Any, h: Header, payload: bytes) -> Header:
    import stat as st

    path = norm_path(h.get("path"))
    recursive = bool(arg(h, "recursive", bool, False))
    entry = bool(arg(h, "entry", bool, False))
    if not st.S_ISDIR(os.stat(path).st_mode):
        raise GuestError("invalid_request", f"{path} is not a directory")
    w = hub().add(path, recursive, entry)
    return {"watcher": w.id, "dirs": len(w.dirs)}


def op_watch_poll(d: Daemon, rid: Any, h: Header, payload: bytes) -> Header:
    wid = arg(h, "watcher", str, required=True)
    limit = arg(h, "max", int, MAX_EVENTS)
    if limit < 1:
        raise GuestError("invalid_request", "max must be at least 1")
    hb = _existing()
    if hb is None:
        raise GuestError("not_found", f"watcher {wid} not found")
    events, overflowed, left = hb.poll(wid, limit)
    # An answer header is at most MAX_HEADER: the rest goes ahead as chunks the client merges.
    batches = protocol.batch_items(events)
    for batch in batches[:-1]:
        d.writer.send({"t": "chunk", "id": rid, "part": "events", "events": batch})
    return {"events": batches[-1], "overflowed": overflowed, "pending": left}


def op_watch_remove(d: Daemon, rid: Any, h: Header, payload: bytes) -> Header:
    wid = arg(h, "watcher", str, required=True)
    hb = _existing()
    if hb is None:
        raise GuestError("not_found", f"watcher {wid} not found")
    hb.remove(wid)
    return {}


def op_watch_list(d: Daemon, rid: Any, h: Header, payload: bytes) -> Header:
    hb = _existing()
    return {"watchers": hb.describe() if hb is not None else []}


OPS: dict[str, Callable[[Daemon, Any, Header, bytes], Header]] = {
    "watch.add": op_watch_add, "watch.poll": op_watch_poll, "watch.remove": op_watch_remove,
    "watch.list": op_watch_list,
}
