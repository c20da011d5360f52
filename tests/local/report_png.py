"""Make ``docs/report.png``, the README's picture of the report page.

Run: ``python -m tests.local.report_png docs/report.png`` (needs chromium). The run is
the README's: incident I1 (``DilutionJob``, per-token loss) reporting every 2 steps,
fixed at step 60, 100 steps; the page is ``trainvitals report`` of its file, shot at
1100 x 820 in headless chromium.
"""

from __future__ import annotations

import base64
import sys
import tempfile
from pathlib import Path

from click.testing import CliRunner

from tests.browser import browser
from tests.e2e._jobs import DilutionJob
from tests.support import one_torch_thread
from trainvitals.hooks import attach
from trainvitals.monitor.cli import main


def make(out: Path) -> None:
    folder = Path(tempfile.mkdtemp(prefix="tv-report-png-"))
    path = folder / "vlm-smoke.jsonl"
    job = DilutionJob()
    with one_torch_thread():
        mon = attach(
            job.model, job.opt, run="vlm-smoke", sink=f"file:{path}", modalities=job.modalities, every=2, rules="off"
        )
        job.train(mon, 60)
        job.fixed = True
        job.train(mon, 40)
        mon.close()
    page = folder / "report.html"
    result = CliRunner().invoke(main, ["report", str(path), "-o", str(page)])
    if result.exit_code:
        raise SystemExit(result.output)
    with browser() as b:
        b.open(page.as_uri(), width=1100, height=820)
        clip = {"x": 0, "y": 0, "width": 1100, "height": 820, "scale": 1}
        shot = b.send("Page.captureScreenshot", {"format": "png", "clip": clip})
    out.write_bytes(base64.b64decode(shot["data"]))


if __name__ == "__main__":
    make(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/report.png"))
