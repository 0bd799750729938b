"""Run inside a stage's container (piped to `python -`): what that container sees of /dev/shm.

Prints one JSON object:

    pid_ns    this container's pid namespace ("pid:[4026532253]")
    entries   every tandem segment and semaphore, as the reaper judges it: name, kind, alive
    held      the names whose flock is held by a process of this container: /proc/locks lists
              only the locks of processes visible in the reader's pid namespace, so this is what
              this container's stage owns (its segments) or consumes (a ring's ".space" lock)

With the arguments `kill MODULE` it sends SIGKILL to this container's `python -m MODULE` process
instead, and prints `killed` (its pid here) and `killed_at` (the host's clock: containers share
it) first: when the container's main process dies, Docker kills this one too.

Only the standard library and the image's own `shm` package: this file is not in the image.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

from shm import reaper


def stage_pid(module: str) -> int:
    """The pid of `python -m MODULE` here (not docker-init, whose command line names it too)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        python = Path(argv[0].decode()).name.startswith("python")
        if python and argv[1:3] == [b"-m", module.encode()]:
            return int(proc.name)
    raise SystemExit(f"no `python -m {module}` process in this container")


def held_names(root: Path = reaper.DEV_SHM) -> list[str]:
    by_file = {}
    for path in root.iterdir():
        try:
            st = path.stat()
        except FileNotFoundError:
            continue  # unlinked since the listing
        by_file[(os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)] = path.name
    held = []
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if "->" in fields or len(fields) < 8 or fields[1] != "FLOCK" or fields[3] != "WRITE":
            continue  # a waiter, a POSIX lock, or a shared lock: not an owner's
        major, minor, inode = fields[5].split(":")
        name = by_file.get((int(major, 16), int(minor, 16), int(inode)))
        if name is not None:
            held.append(name)
    return sorted(held)


def main(argv: list[str]) -> int:
    out: dict[str, object] = {}
    if argv[:1] == ["kill"]:
        pid = stage_pid(argv[1])
        print(json.dumps({"killed": pid, "killed_at": time.time()}), flush=True)
        os.kill(pid, signal.SIGKILL)
        return 0
    out["pid_ns"] = os.readlink("/proc/self/ns/pid")
    out["entries"] = [
        {"name": e.path.name, "kind": e.kind, "alive": e.alive} for e in reaper.scan()
    ]
    out["held"] = held_names()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
