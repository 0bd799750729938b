"""A fault campaign against `tandem serve` on this machine, on loopback; every wait is bounded.

    python -m bench.faults [--quick] [--seed N] [--only NAME,...] [--out-dir bench]

Campaigns (each against its own `tandem serve`, started on free loopback ports, stopped after):
  sigkill        SIGKILLs of each process kind (worker, scheduler, one tokenizer of two) under
                 a 16-stream load; recovery time p50/p99
  cancellations  client cancellations at random points of tokenizing, prefill and decode
  soak           requests at a fixed rate: mixed priorities, lengths, stop strings, sampling,
                 cancellations; memory growth per 1,000 requests; TTFT p99 first/last window
  fuzz           fuzzed requests to every public RPC, each of which must end with a status
  rogue_shm      garbage written into the rings and the prompt arena by a rogue process

Prints the table and writes bench/RESULTS-reliability.md and .json (definitions in
outcome.py, served.py and the campaigns' modules; the .md repeats them).
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.faults import cancels, fuzz, kills, report, rogue, soak
from bench.faults.campaign import Campaign
from bench.faults.outcome import HANG_S
from bench.faults.served import DRAIN_S

SIZES: dict[str, dict[str, Any]] = {
    "sigkill": {"quick": 2, "full": 20},
    "cancellations": {"quick": 60, "full": 1000},
    "soak": {"quick": (600, 200), "full": (10_000, 1000)},  # (requests, window)
    "fuzz": {"quick": 100, "full": 2000},  # per RPC
    "rogue_shm": {"quick": 1, "full": 1},  # repeats of every scenario
}
NOTES_MARKER = "<!-- Everything below this line is written by hand and kept by the benchmark. -->"


def campaigns(size: str, seed: int, rate: float) -> dict[str, Callable[[Path], Campaign]]:
    s = {name: sizes[size] for name, sizes in SIZES.items()}
    requests, window = s["soak"]
    return {
        "sigkill": lambda d: kills.run(d, kills.KillConfig(s["sigkill"], seed)),
        "cancellations": lambda d: cancels.run(d, cancels.CancelConfig(s["cancellations"], seed)),
        "soak": lambda d: soak.run(d, soak.SoakConfig(requests, rate, seed, window)),
        "fuzz": lambda d: fuzz.run(d, fuzz.FuzzConfig(s["fuzz"], seed)),
        "rogue_shm": lambda d: rogue.run(d, rogue.RogueConfig(s["rogue_shm"], seed)),
    }


def _commit() -> str:
    done = subprocess.run(
        ["git", "describe", "--always", "--dirty"], capture_output=True, text=True, check=False
    )
    return done.stdout.strip() or "unknown"


def preamble(args: argparse.Namespace, wall_s: float, commit: str) -> str:
    size = "quick" if args.quick else "full"
    flags = f"{' --quick' if args.quick else ''} --seed {args.seed} --soak-rate {args.soak_rate}"
    return f"""# Reliability: a fault campaign against `tandem serve`

```
python -m bench.faults{flags}
```

{size} run, {datetime.date.today().isoformat()}, commit {commit}, wall time {wall_s / 60:.1f} min
on this machine (2 shared cores; neighbours' load moves every timing). Each campaign runs
against its own `tandem serve` (default flags unless its row says otherwise: the sigkill
campaign serves with `--tokenizers 2 --max-num-seqs 16`, the rogue one with
`--max-num-seqs 6`), on free loopback ports, and stops it after; randomness is seeded.

Definitions:

- **requests**: every call the campaign made (load, probes, victims, witnesses included).
- **ok**: the call ended as asked: a stream with finish reason `stop` or `length`, a unary
  response, or a cancellation the client made itself.
- **clear error**: a failed call that ended with a gRPC status whose details name the problem:
  not UNKNOWN, not INTERNAL's generic "internal error in ...; see server log", not empty, not a
  timeout of the client's own.
- **unclear error**: a failed call that ended any other way.
- **hung**: a call with no message and no end for {HANG_S:.0f} s (the wait is bounded: the
  call is then cancelled and counted).
- **leaked shm**: `tandem-*` segments and semaphores in /dev/shm created by the pipeline's
  processes whose owner is dead while it serves (shm/reaper.py `scan`), or left at all once
  `tandem serve` has stopped.
- **leaked KV blocks**: the scheduler's `Stats` once the load has drained (`running` and
  `waiting` 0, waited for up to {DRAIN_S:.0f} s): `kv_blocks_used` less
  `kv_blocks_session_pinned` (blocks deliberately kept for a session's next turn); -1 if the
  load never drained. The prompt arenas' bytes still allocated (`tandem_shm_bytes_in_use`) are
  in the JSON as `leaked_arena_bytes`.
- **crashed processes**: exits the launcher logged ("NAME exited with code C", or killed while
  starting) that the campaign did not cause; each SIGKILL it sends accounts for one exit of
  that process with code -9.
- **recovery time** (sigkill): from the SIGKILL to the first one-token probe, started after
  it and retried every 0.1 s, that succeeds through the public address; for a tokenizer,
  through the restarted tokenizer's own address (the other one serves the public port all
  along).
"""


def _kept_notes(path: Path) -> str:
    if not path.exists():
        return ""
    text = path.read_text()
    at = text.find(NOTES_MARKER)
    return text[at:] if at >= 0 else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a small version of every campaign")
    parser.add_argument("--seed", type=int, default=18)
    parser.add_argument(
        "--soak-rate",
        type=float,
        default=6.0,
        help="soak arrivals per second (default 6: what this machine's worker sustains)",
    )
    parser.add_argument("--only", default="", help="comma-separated campaign names")
    parser.add_argument("--out-dir", type=Path, default=Path("bench"))
    parser.add_argument("--log-dir", type=Path, default=None, help="default: a temporary dir")
    args = parser.parse_args(argv)
    chosen = campaigns("quick" if args.quick else "full", args.seed, args.soak_rate)
    names = [n for n in args.only.split(",") if n] or list(chosen)
    unknown = set(names) - set(chosen)
    if unknown:
        parser.error(f"unknown campaigns {sorted(unknown)}; choose from {sorted(chosen)}")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="tandem-faults-"))
    print(f"logs in {log_dir}", file=sys.stderr)
    started = time.monotonic()
    results = []
    for name in names:
        print(f"campaign {name} ...", file=sys.stderr, flush=True)
        result = chosen[name](log_dir).to_json()
        results.append(result)
        print(report.table([result]).splitlines()[-1], file=sys.stderr, flush=True)
    wall_s = time.monotonic() - started
    commit = _commit()
    out = {
        "command": " ".join(["python -m bench.faults", *(argv or sys.argv[1:])]),
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "quick": args.quick,
        "seed": args.seed,
        "wall_s": round(wall_s, 1),
        "campaigns": results,
    }
    print(report.table(results))
    notes = _kept_notes(args.out_dir / "RESULTS-reliability.md")
    report.write(args.out_dir, out, preamble(args, wall_s, commit), notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
