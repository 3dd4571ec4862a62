"""``hpcdist report RUN_DIR``: the run's page and figures (report.html and report/ in the run dir, or --out)."""

from __future__ import annotations

import argparse

from hpcdist.base.errors import CommandError, refusing
from hpcdist.report.plots import MissingMatplotlib


@refusing("report", MissingMatplotlib)
def cmd_report(args: argparse.Namespace) -> int:
    from hpcdist.base.rundir import RunDir
    from hpcdist.report.page import write_report

    if not args.run_dir.is_dir():
        raise CommandError(f"report: {args.run_dir} is not a directory (give the run's run.dir)")
    rd = RunDir(args.run_dir)
    out = args.out or rd.report
    images = rd.report_images if args.out is None else out.with_suffix("")  # report.html -> report/
    page, pngs = write_report(args.run_dir, out, images)
    drawn = [p.name for p in pngs.values() if p is not None]
    print(f"wrote {page} and {len(drawn)} figure(s) in {images}/: {', '.join(drawn) or 'none (nothing recorded)'}")
    return 0
