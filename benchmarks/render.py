"""Write BENCHMARKS.md's tables from the records in benchmarks/results/ (see record.py).

    .venv/bin/python benchmarks/render.py        # `make bench` runs it after the benchmarks

Each block `<!-- bench:SECTION RECORD ... -->` ... `<!-- /bench:SECTION -->` gets a table per
record of that section, its command, host and run named once above it: the records the marker
names first, in that order, then any other record of the section by name. A section no block
holds is added at the end under its own heading, so a new script's figures show up without
editing the file; an empty one says so. The block `<!-- bench:hosts -->` gets every host the
rows ran on. Everything outside the blocks is left as written.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from record import RESULTS, ROOT

BLOCK = re.compile(r"<!-- bench:(?P<section>[\w-]+)(?P<names>[^>]*?)-->\n.*?<!-- /bench:(?P=section) -->",
                   re.DOTALL)
HOSTS = "hosts"


def load(results: Path = RESULTS) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(results.glob("*.json"))]


def render(text: str, records: list[dict]) -> str:
    placed = set()

    def fill(match: re.Match) -> str:
        section, names = match["section"], match["names"].split()
        placed.add(section)
        if section == HOSTS:
            body = hosts_table(records)
        else:
            ordered = sorted((r for r in records if r["section"] == section),
                             key=lambda r: (names.index(r["name"]) if r["name"] in names else len(names), r["name"]))
            body = section_table(ordered)
        return f"<!-- bench:{section}{match['names']}-->\n{body}\n<!-- /bench:{section} -->"

    text = BLOCK.sub(fill, text)
    for section in sorted({r["section"] for r in records} - placed):
        body = section_table([r for r in records if r["section"] == section])
        text = text.rstrip("\n") + f"\n\n## {section}\n\n<!-- bench:{section} -->\n{body}\n<!-- /bench:{section} -->\n"
    return text


def section_table(records: list[dict]) -> str:
    if not records:
        return "_No figures yet: no record names this section (see the top of this file)._"
    return "\n\n".join(record_table(record) for record in records)


def record_table(record: dict) -> str:
    """One record's rows under one line naming its command, host and run: said once, above the
    table, not in every row. What the rows ran on (threads, dtype, engine) joins that line when
    every row shares it, else it is a column; the goal column shows only where a row has one."""
    rows = record["rows"]
    ran = [ran_on(row) for row in rows]
    shared = ran[0] if rows and all(r == ran[0] for r in ran) else []
    host = ", ".join([slug(record["host"]), *shared])
    when = ", ".join(filter(None, [record["date"], "quick" if record["quick"] else "",
                                   f"load {record['load']}", record["note"]]))
    caption = f"`{record['command']}` · {host} · {when}"
    goals, per_row = any(row["goal"] for row in rows), bool(rows) and not shared and any(ran)
    header = ["figure", *(["goal"] if goals else []), "measured", *(["ran on"] if per_row else [])]
    lines = [caption, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row, on in zip(rows, ran):
        cells = [row["figure"], *([goal(row)] if goals else []), row["measured"], *([", ".join(on)] if per_row else [])]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines)


def ran_on(row: dict) -> list[str]:
    """What a row ran on beyond its host: torch's threads, the dtype, the engine, where named."""
    return [f"{row['threads']} thr" if key == "threads" else str(row[key])
            for key in ("threads", "dtype", "engine") if row.get(key)]


def goal(row: dict) -> str:
    if not row["goal"]:
        return "–"
    return row["goal"] + ("" if row["met"] is None else ": **met**" if row["met"] else ": **missed**")


def hosts_table(records: list[dict]) -> str:
    newest: dict[str, dict] = {}
    for record in sorted(records, key=lambda r: r["date"]):
        newest[slug(record["host"])] = record
    lines = ["| host | CPU | torch capability | cores | memory | GPU | torch, Python | newest figure |",
             "|---|---|---|---|---|---|---|---|"]
    for name, record in sorted(newest.items(), key=lambda item: item[1]["date"], reverse=True):
        h = record["host"]
        lines.append(f"| {name} | {h['arch']} {h['cpu']} | {h.get('capability', '?')} | {h['cores']} | "
                     f"{str(h['memory_gib']) + ' GiB' if 'memory_gib' in h else '?'} | {h.get('gpu') or '–'} | {h.get('torch', '–')}, "
                     f"{h.get('python', '?')} | {record['date']} |")
    return "\n".join(lines)


def slug(h: dict) -> str:
    """A host in a few words: the CPU's model without its vendor's decorations, torch's vector
    ISA, the cores, the GPU."""
    cpu = re.sub(r"\(R\)|\(TM\)|\bCPU\b|\bProcessor\b|@.*|\b(Intel|AMD)\b", " ", h["cpu"])
    words = [" ".join(cpu.split()) or h["arch"], h.get("capability"), f"{h['cores']} cores", h.get("gpu")]
    return " · ".join(word for word in words if word)


def main() -> int:
    path = ROOT / "BENCHMARKS.md"
    path.write_text(render(path.read_text(), load()))
    print(f"rendered {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
