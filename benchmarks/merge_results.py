"""One results file from several runs of one benchmark, with its plot.

    python benchmarks/merge_results.py OUT.json IN.json [IN.json ...] --command "what produced the inputs"

A lent GPU machine runs one command for at most ten minutes, so a benchmark's run of record is often
several processes (``train --shapes 1``, then ``--shapes 2,3``; ``attention --head-dims 64,128``, then
``--head-dims 256``). This concatenates their rows (each list of the training benchmark's results)
and writes them with one ``info``: the inputs' device, date, versions and commit, which must agree, and
``--command``, the commands that produced the inputs. The plot is drawn as the benchmark draws it,
beside OUT.json. The benchmark is OUT's name: ``train``, ``attention``, ``decode``, ...
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

AGREE = ("device", "torch", "triton", "commit")  # what makes the inputs one run of record


def merge(results: list[dict], command: str) -> dict:
    infos = [r["info"] for r in results]
    for field in AGREE:
        values = {info.get(field) for info in infos}
        if len(values) > 1:
            raise ValueError(f"the inputs differ in {field}: {sorted(map(str, values))}")
    dates = sorted({info["date"] for info in infos})
    info = {**infos[0], "date": " to ".join([dates[0], dates[-1]] if len(dates) > 1 else dates), "command": command}
    first = results[0]["rows"]
    if isinstance(first, dict):  # the training benchmark: a dict of lists
        rows = {key: [row for r in results for row in r["rows"][key]] for key in first}
    else:
        rows = [row for r in results for row in r["rows"]]
    return {"info": info, "rows": rows}


def plot(name: str, rows, path: pathlib.Path) -> None:
    if name == "train":
        from portable_ops.bench.train import plot as plot_train

        plot_train(rows, path)
    else:
        from portable_ops.bench.__main__ import plot as plot_bench

        plot_bench(name, rows, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("inputs", type=pathlib.Path, nargs="+")
    parser.add_argument("--command", required=True, help="the commands that produced the inputs")
    parser.add_argument("--no-plot", action="store_true", help="the benchmark draws no plot (features, nki)")
    args = parser.parse_args(argv)
    merged = merge([json.loads(p.read_text()) for p in args.inputs], args.command)
    args.out.write_text(json.dumps(merged, indent=1))
    if not args.no_plot:
        plot(args.out.stem, merged["rows"], args.out.with_suffix(".png"))
    print(f"wrote {args.out}: {merged['info']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
