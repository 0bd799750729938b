"""The campaign's table, printed and written as RESULTS-reliability.md and .json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

COLUMNS = (
    ("campaign", "name"),
    ("requests", "requests"),
    ("ok", "ok"),
    ("clear error", "clear_error"),
    ("unclear error", "unclear_error"),
    ("hung", "hung"),
    ("leaked shm", "leaked_shm"),
    ("leaked KV blocks", "leaked_kv_blocks"),
    ("crashed processes", "crashed_processes"),
    ("wall s", "wall_s"),
)


def table(campaigns: list[dict[str, Any]]) -> str:
    head = "| " + " | ".join(title for title, _ in COLUMNS) + " |"
    rule = "|" + "|".join("---" if key == "name" else "---:" for _, key in COLUMNS) + "|"
    rows = []
    for c in campaigns:
        cells = [f"{c[key]:,}" if isinstance(c[key], int) else str(c[key]) for _, key in COLUMNS]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join([head, rule, *rows])


def _fmt(value: object) -> str:
    return "–" if value is None else str(value)


def highlights(campaigns: list[dict[str, Any]]) -> list[str]:
    """One line per campaign of what its table row cannot say."""
    lines = []
    for c in campaigns:
        name = c["name"]
        if name == "sigkill":
            parts = [
                f"{kind} p50 {_fmt(r['p50'])} s / p99 {_fmt(r['p99'])} s"
                for kind, r in c["recovery_s"].items()
            ]
            lines.append(
                f"- **sigkill**: {c['kills_per_kind']} SIGKILLs of each kind under "
                f"{c['streams']} streams; recovery (kill to the first request served by the "
                f"restarted process's kind): {'; '.join(parts)}."
            )
        elif name == "cancellations":
            lines.append(
                f"- **cancellations**: {c['cancel_requests']:,} cancelled by the client, landed "
                f"{c['landed_phase']}; witnesses {c['witness_statuses']}; scheduler finished "
                f"{c.get('finished_by_reason', {})}."
            )
        elif name == "soak":
            lines.append(
                f"- **soak**: {c['rate_per_s']} requests/s asked, {c['achieved_rate_per_s']} "
                f"achieved; RSS growth MiB per 1,000 requests after the first window "
                f"{c['rss_growth_mib_per_thousand']}; TTFT p99 first {c['window']:,}: "
                f"{_fmt(c['ttft_p99_first_window_s'])} s, last {c['window']:,}: "
                f"{_fmt(c['ttft_p99_last_window_s'])} s."
            )
        elif name == "fuzz":
            per = {rpc: v["statuses"] for rpc, v in c["by_rpc"].items()}
            lines.append(f"- **fuzz**: statuses by RPC {per}.")
        elif name == "rogue_shm":
            for s in c["scenarios"]:
                lines.append(
                    f"- **rogue** {s['segment']} {s['mode']}: wrote {s['wrote']!r}; victim "
                    f"{s['victim']}; load {s['load_statuses']}; recovered in "
                    f"{_fmt(s['probe_recovery_s'])} s; exits {s['process_exits']}; arena bytes "
                    f"held after {s['arena_bytes_held_after']}."
                )
    return lines


def write(out_dir: Path, results: dict[str, Any], preamble: str, notes: str) -> None:
    """The JSON, and the .md: preamble, table, highlights, then `notes` (kept from before)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "RESULTS-reliability.json").write_text(json.dumps(results, indent=1) + "\n")
    campaigns = results["campaigns"]
    parts = [
        preamble,
        table(campaigns),
        "What the rows do not show:",
        "\n".join(highlights(campaigns)),
    ]
    if notes:
        parts.append(notes.rstrip())
    (out_dir / "RESULTS-reliability.md").write_text("\n\n".join(parts) + "\n")
