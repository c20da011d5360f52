"""Run names: one rule (trainvitals.wire.runs), and every place that checks one uses it.

A name the wire refuses is refused at once wherever it enters (attach, the environment,
``trainvitals run``, the settings routes, both decoders of a report), with the same rule;
the last test reads the source tree for copies of the rule."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from tests.support import running_collector
from trainvitals.hooks import attach
from trainvitals.hooks.integration_support import run_name
from trainvitals.monitor.cli import main
from trainvitals.monitor.decode import BodyInvalid, decode_batch
from trainvitals.wire import Report
from trainvitals.wire.errors import ConfigurationError
from trainvitals.wire.runs import MAX_RUN, RUN_PATTERN, RUN_REGEX, RUN_RULE, check_run, is_run

ROOT = Path(__file__).resolve().parents[2]

GOOD = ["r1", "a/b", "team:exp-1/run_2.3", ".hidden", "..x", "a/.b/..c", "x" * MAX_RUN]
BAD = ["", "r1\n", "r1\r\n", "\nr1", "a b", "a//b", "/a", "a/", ".", "..", "a/./b", "a/../b", "x" * (MAX_RUN + 1)]


def _report(run: str) -> dict:
    return {"run": run, "step": 1, "time": 1.0}


@pytest.mark.parametrize("run", GOOD)
def test_good_names_pass_every_check(run):
    assert check_run(run) == run and is_run(run)
    Report.model_validate(_report(run))
    decode_batch(json.dumps({"schema": 1, "reports": [_report(run)]}).encode())


@pytest.mark.parametrize("run", BAD)
def test_bad_names_fail_every_check_with_the_rule(run):
    with pytest.raises(ConfigurationError, match=re.escape(RUN_RULE)):
        check_run(run)
    assert not is_run(run)
    with pytest.raises(ValidationError):
        Report.model_validate(_report(run))
    with pytest.raises(BodyInvalid, match=r"reports\.0\.run"):
        decode_batch(json.dumps({"schema": 1, "reports": [_report(run)]}).encode())


def test_attach_refuses_a_trailing_newline_at_once(monkeypatch):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"run='r1\\n': use 1-128 characters"):
        attach(model, opt, run="r1\n", sink="null")
    monkeypatch.setenv("TRAINVITALS_RUN", "a//b")  # (the environment's values are stripped)
    with pytest.raises(ValueError, match=r"TRAINVITALS_RUN='a//b'"):
        attach(model, opt, sink="null")
    assert not opt._optimizer_step_pre_hooks  # nothing attached


def test_trainvitals_run_refuses_it_before_starting_the_job():
    result = CliRunner().invoke(main, ["run", "--run", "r1\n", "--collector", "null", "--", "python", "-c", "1"])
    assert result.exit_code == 1 and "run name 'r1\\n'" in result.output and RUN_RULE in result.output


def test_the_settings_routes_refuse_it():
    with running_collector() as c:
        assert c.client.put("/v1/runs/r1%0A/settings", json={"every": 1}).status_code in (404, 422)
        answer = c.client.put("/v1/runs/a//b/settings", json={"every": 1})
        assert answer.status_code == 422 and RUN_RULE in answer.json()["detail"]


@pytest.mark.parametrize("given_name", ["my run (v2)", "a//b/", "../../etc", "./x/.", "ü" * 300])
def test_names_made_from_framework_values_are_valid(given_name):
    assert is_run(run_name(given_name, default="fallback"))


@given(st.text(alphabet=st.sampled_from("ab.:/_-\n "), max_size=12))
def test_the_json_pattern_and_the_python_check_agree(text):
    # RUN_PATTERN is what JSON Schema and pydantic read ($ = end of text there);
    # RUN_REGEX is the Python form. Both mean what is_run says.
    assert is_run(text) == (bool(re.search(RUN_REGEX, text)) and len(text) <= MAX_RUN)
    try:
        Report.model_validate(_report(text))
    except ValidationError:
        assert not is_run(text)
    else:
        assert is_run(text)
    assert RUN_PATTERN.startswith("^") and RUN_PATTERN.endswith("$")


# -- no copies: every run-name check in the tree is the one in trainvitals.wire.runs --------
_PACKAGES = ("hooks", "monitor", "alerts", "wire", "demo")
_COPIES = {
    "the run-name character class": re.compile(r"A-Za-z0-9_\.?:\\?-"),
    "the run-name pattern compiled again": re.compile(r"re\.(compile|match|fullmatch|search)\(\s*(PATH_)?RUN_"),
    "a run-name length written out": re.compile(
        r"len\(run\)\s*<=?\s*\d|\[:\s*128\b|max_length=128,\s*pattern=\w*RUN|\"maxLength\": 128"
    ),
    "the rule written out": re.compile(r"1-128 characters"),
}


def test_no_module_but_wire_runs_spells_the_rule():
    found = []
    for package in _PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "wire" / "runs.py":
                continue
            text = path.read_text(encoding="utf-8")
            for what, pattern in _COPIES.items():
                for m in pattern.finditer(text):
                    line = text.count("\n", 0, m.start()) + 1
                    found.append(f"{path.relative_to(ROOT)}:{line}: {what}: {m.group(0)!r}")
    assert not found, "\n".join(found)


def test_the_copy_detector_finds_the_old_copies():
    # The forms the tree had before one check existed: each is caught.
    old = [
        r'_RUN_PART = r"(?:[A-Za-z0-9_:\-][A-Za-z0-9_.:\-]*)"',
        "_RUN_RE = re.compile(RUN_PATTERN)",
        "if not (len(run) <= 128 and _RUN_RE.match(run)):",
        "Meta(min_length=1, max_length=128, pattern=_RUN)",
        "The run's name (1-128 characters from letters",
        '_BAD = re.compile(r"[^A-Za-z0-9_.:\\-/]+")',
    ]
    for text in old:
        assert any(p.search(text) for p in _COPIES.values()), text
