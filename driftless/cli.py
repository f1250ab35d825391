"""The ``driftless`` command (also ``python -m driftless``)."""

from __future__ import annotations

import argparse
import json
import sys


def _seed_table(args) -> int:
    """Seed 000's worked example, computed by running the library's objectives exactly."""
    from driftless.analysis import expected_logit_update

    p, q, adv = args.p, args.q, args.advantages
    rows = [("pg", {}, "raw E_q[A s_z]"), ("sc", {}, "SC Cov_q(A, s_z)"), ("is", {}, "exact IS E_p[A s_z]"),
            ("sc+kl", {"beta": args.beta}, f"SC + sampler KL, beta={args.beta}"),
            ("tis", {}, "TIS (cap 2)"), ("sc+tis", {}, "SC + TIS"), ("sc+mis", {}, "SC + MIS"),
            ("reinforce-zero", {}, "REINFORCE Zero")]
    out = {}
    print(f"Expected logit update at one prefix: p={p}, q={q}, A={adv}")
    print(f"| {'objective':<16} | {'what':<30} | update |")
    print(f"|{'-' * 18}|{'-' * 32}|--------|")
    for name, params, what in rows:
        vec = expected_logit_update(p, q, adv, name, **params).tolist()
        out[name] = vec
        print(f"| {name:<16} | {what:<30} | ({', '.join(f'{x:.2f}' for x in vec)}) |")
    if args.json:
        print(json.dumps(out))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="driftless", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser("seed-table", help="seed 000's expected-update table, computed by the objectives")
    t.add_argument("--p", type=float, nargs="+", default=[0.8, 0.2])
    t.add_argument("--q", type=float, nargs="+", default=[0.5, 0.5])
    t.add_argument("--advantages", type=float, nargs="+", default=[2.0, 0.0])
    t.add_argument("--beta", type=float, default=0.2)
    t.add_argument("--json", action="store_true")
    t.set_defaults(func=_seed_table)

    d = sub.add_parser("demo", help="the main job on the embedded default")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=_demo)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:
        print(f"driftless: error: {err}", file=sys.stderr)
        return 2


def _demo(args) -> int:
    ns = argparse.Namespace(p=[0.8, 0.2], q=[0.5, 0.5], advantages=[2.0, 0.0], beta=0.2, json=args.json)
    return _seed_table(ns)


if __name__ == "__main__":
    raise SystemExit(main())
