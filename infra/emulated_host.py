"""Turn a fresh set of Linux namespaces into one emulated SageMaker instance, then become its container command.

Run by path, by `infra.sagemaker_emulator`, as the first process of new mount, UTS and PID namespaces
(`unshare --mount --uts --pid --fork --mount-proc`): it binds the host's own tree over `/opt/ml` and a hosts file
naming every `algo-N` over `/etc/hosts`, sets the hostname, then execs the container's command, which so becomes
PID 1 of the instance, as in a SageMaker container. Standard library only: it runs before anything else.

    python emulated_host.py <host's opt/ml folder> <hosts file> <hostname> -- <command> [args...]
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

OPT_ML = "/opt/ml"


def bind(source: str, target: str) -> None:
    subprocess.run(["mount", "--bind", source, target], check=True)


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") != 3 or len(argv) < 5:
        print(__doc__, file=sys.stderr)
        return 2
    ml, hosts_file, hostname = argv[:3]
    command = argv[4:]
    if not os.path.isdir(OPT_ML):
        try:
            os.makedirs(OPT_ML)  # an empty mount point on the real file system; each instance binds over it
        except OSError as exc:
            print(f"emulated host: cannot create the mount point {OPT_ML} ({exc}): create it once, as root "
                  f"(mkdir -p {OPT_ML})", file=sys.stderr)  # fmt: skip
            return 125
    bind(ml, OPT_ML)
    bind(hosts_file, "/etc/hosts")
    socket.sethostname(hostname)
    os.chdir("/")
    os.execvp(command[0], command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
