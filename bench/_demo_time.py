"""bench/demo_time.sh's summary: a timed fresh-clone `make demo` as JSON (phases from the runs' own files)."""

import argparse
import json
import re
import subprocess
from pathlib import Path

from driftless.recipes.demo import METHODS, RECORD, differences


def console_lines(text: str, last: int = 40) -> list[str]:
    """The console as a person saw it: each line's last redraw (tqdm rewrites a line with carriage returns)."""
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text)  # tqdm's cursor moves
    lines = [line.split("\r")[-1].rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    return [line for line in lines if line][-last:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--clone", type=Path, required=True)
    p.add_argument("--start", type=float, required=True)
    p.add_argument("--end", type=float, required=True)
    p.add_argument("--install-s", type=float)
    p.add_argument("--time-v", type=Path)
    p.add_argument("--console", type=Path)
    p.add_argument("--kind", default="")
    p.add_argument("--status", type=int, default=0, help="make demo's exit status")
    args = p.parse_args()
    run_dir = args.clone / "runs" / "demo"
    at = lambda path: round(path.stat().st_mtime - args.start, 1)  # seconds after `make demo` began
    warm = sorted(args.clone.glob("runs/warmstart/*/info.json"))
    runs = {m: run_dir / m / "seed0" for m in METHODS}
    started = {m: at(r / "initial_eval.json") for m, r in runs.items() if (r / "initial_eval.json").exists()}
    done = {m: at(r / "done.json") for m, r in runs.items() if (r / "done.json").exists()}
    order = sorted(done, key=done.get)
    pairs = [order[i:i + 2] for i in range(0, len(order), 2)]
    warm_s = at(warm[0]) if warm else None
    phases = {"warm_start_s": warm_s,
              "workers_start_s": round(min(started.values()) - warm_s, 1) if started and warm_s else None}
    previous = None
    for i, pair in enumerate(pairs, 1):  # the first from its runs' start, each later one from the end of the one before
        begin = min(started.get(m, done[m]) for m in pair) if previous is None else previous
        previous = max(done[m] for m in pair)
        phases[f"pair{i}_s"] = {"methods": pair, "seconds": round(previous - begin, 1)}
    total = round(args.end - args.start, 1)
    phases["report_s"] = round(total - previous, 1) if previous is not None else None
    peak_kb = None
    if args.time_v and args.time_v.exists():
        found = re.search(r"Maximum resident set size \(kbytes\): (\d+)", args.time_v.read_text())
        peak_kb = int(found.group(1)) if found else None
    out = {
        "kind": args.kind,
        "commit": subprocess.run(["git", "-C", str(args.clone), "rev-parse", "--short", "HEAD"],
                                 capture_output=True, text=True, check=False).stdout.strip(),
        "make_demo_s": total, "goal_s": 600, "exit_status": args.status, "install_s": args.install_s,
        "phases": phases, "runs_started_s": started, "runs_done_s": done,
        "peak_rss_gb": round(peak_kb / 2**20, 2) if peak_kb else None,
        "differences_from_record": differences(run_dir, RECORD) if len(done) == len(METHODS) else ["runs missing"],
        "console_tail": console_lines(args.console.read_text()) if args.console and args.console.exists() else [],
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
