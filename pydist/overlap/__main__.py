"""python -m pydist.overlap merge|report: see trace.py and report.py.

    python -m pydist.overlap merge DIR [-o DIR/merged.json]      every DIR/rank*.json
    python -m pydist.overlap merge a.json b.json -o merged.json
    python -m pydist.overlap report TRACE.json [--plot OUT.png] [--step N] [--rank R]
    python -m pydist.overlap report DIR [--json]                  every DIR/rank*.json, merged in memory
    python -m pydist.overlap predict DIR [--link BW,LAT] [--bucket-cap-mb C] [--chunk-mb K]
                                     [--recommend C1,C2,...] [--recorded-link BW,LAT] [--json]
                                                                  the step at other settings (predict.py)
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

from pydist.overlap import predict, report, trace


def _rank_files(inputs: list[str]) -> list[str]:
    paths = []
    for item in inputs:
        if os.path.isdir(item):
            numbered = [(int(m.group(1)), p) for p in glob.glob(os.path.join(item, "rank*.json"))
                        if (m := re.fullmatch(r"rank(\d+)\.json", os.path.basename(p)))]
            if not numbered:
                raise SystemExit(f"pydist.overlap merge: no rank<N>.json in {item}")
            paths += [p for _, p in sorted(numbered)]
        else:
            paths.append(item)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pydist.overlap", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    merge = commands.add_parser("merge", help="merge ranks' traces into one, on a common clock")
    merge.add_argument("inputs", nargs="+", help="a PYDIST_TRACE directory, or trace files")
    merge.add_argument("-o", "--output", help="default: merged.json beside the inputs")
    rep = commands.add_parser("report", help="per-bucket table of a trace; --plot draws one step")
    rep.add_argument("trace", help="a trace file (one rank's or merged) or a PYDIST_TRACE directory")
    rep.add_argument("--json", action="store_true", help="print one JSON object (stragglers included) instead")
    rep.add_argument("--plot", metavar="OUT.png", help="draw one step's timeline (needs matplotlib)")
    rep.add_argument("--step", type=int, help="the step to draw (default: the worst by exposed time)")
    rep.add_argument("--rank", type=int, help="the rank to draw (default: the first in the trace)")
    pre = commands.add_parser("predict", help="predict the step under another link, bucket cap or chunk size")
    pre.add_argument("trace", help="a PYDIST_TRACE directory (every rank's file) or a merged trace")
    pre.add_argument("--link", metavar="BW,LAT",
                     help="the link to predict, PYDIST_SIM_NET's syntax (default: the recorded one); with "
                          "--recorded-link a real link's rate, else a simulated link")
    pre.add_argument("--recorded-link", metavar="BW,LAT",
                     help="the recorded run crossed this real link, which pydist did not simulate (e.g. gloo between "
                          "hosts over a link shaped to 1Gbps): its modelled time is taken off the recorded "
                          "collectives and the --link's added back ([Note: simulated and real links] in "
                          "pydist/overlap/predict.py); default: the run's simulated link, or none")
    pre.add_argument("--bucket-cap-mb", type=float, metavar="C", help="default: the recorded cap")
    pre.add_argument("--first-bucket-cap-mb", type=float, metavar="C", help="default: the bucket cap (the wrapper's rule)")
    pre.add_argument("--chunk-mb", type=float, metavar="K", help="allreduce_chunk_mb, 0: whole buckets (default: the recorded one)")
    pre.add_argument("--recommend", metavar="C1,C2,...",
                     help="the caps to weigh for the recommended one (default: 0.25,1,4,25, the recorded cap and "
                          "--bucket-cap-mb; see [Note: the recommended cap] in pydist/overlap/predict.py)")
    pre.add_argument("--wrapper", type=int, help="which DDP wrapper of the trace (default: the first)")
    pre.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.command == "predict":
        return _predict(args)

    # A file that cannot be read, or is not a trace, is named with what is
    # wrong, on stderr, and exits 2: no traceback (load_trace and the
    # report's reading raise ValueError for a damaged file).
    if args.command == "merge":
        paths = _rank_files(args.inputs)
        output = args.output or os.path.join(os.path.dirname(os.path.abspath(paths[0])), "merged.json")
        try:
            document = trace.merge_traces(paths)
            trace.write_trace(output, document)
        except (OSError, ValueError) as exc:
            print(f"pydist.overlap merge: {exc}", file=sys.stderr)
            return 2
        print(f"merged {len(paths)} traces (ranks {document['otherData']['merged_ranks']}) into {output}")
        return 0
    def read():
        document = _load(args.trace)
        return document, (json.dumps(report.report_json(document), indent=1) + "\n" if args.json
                          else report.report_text(document))

    read = _reading("report", args.trace, read)
    if read is _FAILED:
        return 2
    document, text = read
    sys.stdout.write(text)
    if args.plot:
        try:
            chosen = report.plot_step(document, args.plot, step=args.step, rank=args.rank)
        except (RuntimeError, ValueError) as exc:
            print(f"pydist.overlap report: {exc}", file=sys.stderr)
            return 2
        print(f"drew rank {chosen.rank}, step {chosen.step} into {args.plot}")
    return 0


_FAILED = object()  # what _reading returns when it named a fault


def _reading(command: str, path: str, work):
    """``work()``'s result, or _FAILED with the fault named on stderr (no
    traceback) when reading the trace at ``path`` fails: a ValueError (the
    file's or an option's fault), a value of another type where the reader
    checks none (KeyError, TypeError), an OSError."""
    try:
        return work()
    except ValueError as exc:
        text = str(exc)
        where = "" if text.startswith(f"{path}:") or text.startswith("--") else f"{path}: "
        print(f"pydist.overlap {command}: {where}{text}", file=sys.stderr)
    except (KeyError, TypeError) as exc:
        print(f"pydist.overlap {command}: {path}: not a trace {command} can read "
              f"({type(exc).__name__}: {exc})", file=sys.stderr)
    except OSError as exc:
        print(f"pydist.overlap {command}: {exc}", file=sys.stderr)
    return _FAILED


def _load(path: str) -> dict:
    """A trace file, or a PYDIST_TRACE directory merged in memory; ValueError naming what is wrong."""
    if os.path.isdir(path):
        try:
            return trace.merge_traces(_rank_files([path]))
        except SystemExit as exc:  # no rank files there
            raise ValueError(str(exc).replace("pydist.overlap merge: ", "")) from None
    return trace.load_trace(path)


def _predict(args) -> int:
    def work():
        for name in ("bucket_cap_mb", "first_bucket_cap_mb"):
            value = getattr(args, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 (MB), got {value:g}")
        if args.chunk_mb is not None and not args.chunk_mb >= 0:
            raise ValueError(f"--chunk-mb must be >= 0 (MB; 0: whole buckets), got {args.chunk_mb:g}")
        caps = None
        if args.recommend is not None:
            try:
                caps = [float(c) for c in args.recommend.split(",")]
            except ValueError:
                raise ValueError(f"--recommend {args.recommend!r}: expected caps in MB separated by commas, "
                                 "e.g. 0.25,1,4,25") from None
            if not caps or any(not c > 0 for c in caps):
                raise ValueError(f"--recommend {args.recommend!r}: every cap must be > 0 (MB)")
        for name in ("link", "recorded_link"):
            if getattr(args, name) is not None:
                try:
                    predict.network.parse_link(getattr(args, name))
                except ValueError as exc:
                    raise ValueError(f"--{name.replace('_', '-')}: {exc}") from None
        return predict.predict_json(_load(args.trace), link=args.link, bucket_cap_mb=args.bucket_cap_mb,
                                    first_bucket_cap_mb=args.first_bucket_cap_mb, chunk_mb=args.chunk_mb,
                                    recommend_caps=caps, wrapper=args.wrapper, recorded_link=args.recorded_link)

    result = _reading("predict", args.trace, work)  # errors as report's: named on stderr, exit 2
    if result is _FAILED:
        return 2
    sys.stdout.write(json.dumps(result, indent=1) + "\n" if args.json else predict.predict_text(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
