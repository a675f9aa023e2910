"""Turn fresh Linux namespaces into one emulated SageMaker instance, then exec its container command as PID 1.

`infra.backends.emulator` runs it by path under `unshare --mount --uts --pid --fork --mount-proc`. It binds the host's
tree over /opt/ml and a hosts file over /etc/hosts, and sets the hostname. With --private, /tmp, /dev/shm and /root
become the host's own, since SageMaker hosts share nothing but the network; --keep paths are bound back. Mounts stay in
this namespace. Standard library only.

    python emulated_host.py [--private DIR] [--keep PATH]... <opt/ml folder> <hosts file> <hostname> -- <command>...
"""

from __future__ import annotations

import argparse
import ctypes
import os
import socket
import sys

OPT_ML = "/opt/ml"
HOME = "/root"
"""The home of a SageMaker training container, which runs as root."""
COVERED = ("/tmp", "/dev/shm", HOME)
MS_NOSUID, MS_NODEV, MS_BIND = 2, 4, 4096  # <sys/mount.h>

_libc = ctypes.CDLL(None, use_errno=True)


def mount(source: str, target: str, fstype: str | None = None, flags: int = MS_BIND, data: str | None = None) -> None:
    """mount(2); a bind mount by default."""
    encoded = [None if x is None else x.encode() for x in (source, target, fstype, data)]
    if _libc.mount(encoded[0], encoded[1], encoded[2], ctypes.c_ulong(flags), encoded[3]) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {source} on {target}: {os.strerror(errno)}")


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _handle(path: str) -> str:
    """A path naming `path`'s file even under a later mount: /proc/self/fd of an O_PATH descriptor (closed on exec)."""
    return f"/proc/self/fd/{os.open(path, os.O_PATH)}"


def isolate(private: str, keep: list[str]) -> None:
    """Cover /tmp, /dev/shm and /root with this host's own, binding `keep` back."""
    for folder in ("tmp", "home"):
        os.makedirs(os.path.join(private, folder), exist_ok=True)
    os.chmod(os.path.join(private, "tmp"), 0o1777)
    os.makedirs(HOME, exist_ok=True)
    kept = sorted({os.path.realpath(p) for p in keep if os.path.exists(p)})
    kept = [p for p in kept if any(_within(p, c) for c in COVERED)]
    kept = [p for i, p in enumerate(kept) if not any(_within(p, q) for q in kept[:i])]  # not inside another
    handles = {p: _handle(p) for p in kept}
    tmp, home = _handle(os.path.join(private, "tmp")), _handle(os.path.join(private, "home"))
    mount(tmp, "/tmp")
    mount(home, HOME)
    mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    for path, handle in handles.items():
        if os.path.isdir(handle):
            os.makedirs(path, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "ab").close()  # a file to mount the file on
        mount(handle, path)


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print(__doc__, file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="emulated_host.py")
    parser.add_argument("--private", help="this host's folder for its own /tmp and home")
    parser.add_argument("--keep", action="append", default=[], help="a path that stays reachable under them")
    parser.add_argument("ml")
    parser.add_argument("hosts_file")
    parser.add_argument("hostname")
    args = parser.parse_args(argv[:split])
    command = argv[split + 1 :]
    if not command:
        print(__doc__, file=sys.stderr)
        return 2
    if not os.path.isdir(OPT_ML):
        try:
            # An empty mount point on the real file system; each instance binds over it. exist_ok: the hosts of one
            # job start together, and another may have made it a moment ago.
            os.makedirs(OPT_ML, exist_ok=True)
        except OSError as exc:
            print(f"emulated host: cannot create the mount point {OPT_ML} ({exc}): create it once, as root "
                  f"(mkdir -p {OPT_ML})", file=sys.stderr)  # fmt: skip
            return 125
    mount(args.ml, OPT_ML)
    mount(args.hosts_file, "/etc/hosts")
    if args.private:
        isolate(args.private, args.keep)
    socket.sethostname(args.hostname)
    os.chdir("/")
    os.execvp(command[0], command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
