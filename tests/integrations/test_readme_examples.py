"""The README's Trainer and Lightning examples run as they are written (each in a
fresh process, in an empty folder, offline) and report through the default sink."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Hugging Face Trainer and Lightning"


def examples() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert SECTION in text, f"README.md has no section {SECTION!r}"
    body = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", body, flags=re.S)
    assert len(blocks) == 2, f"expected the Trainer and the Lightning example, found {len(blocks)} blocks"
    return blocks


@pytest.mark.parametrize(
    ("index", "report_file", "printed"),
    [(0, "trainvitals-out.jsonl", 1.0), (1, "trainvitals-lightning.jsonl", 2.0)],
    ids=["trainer", "lightning"],
)
def test_readme_example_runs_and_reports(tmp_path, index, report_file, printed):
    code = examples()[index]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINVITALS_")}
    env.update(HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert float(proc.stdout.strip().splitlines()[-1]) == pytest.approx(printed, rel=1e-5)
    reports = [json.loads(line) for line in (tmp_path / report_file).read_text().splitlines()]
    names = {s["name"] for r in reports for s in r.get("samples", [])}
    assert {"loss_weight_mass", "modality_grad_share_ratio", "microbatches"} <= names
    assert any(e["kind"] == "run_end" for r in reports for e in r.get("events", []))
