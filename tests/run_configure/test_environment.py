"""``TRAINVITALS_*`` variables for every ``attach`` option: each parsed with its field's
type, a bad one refused naming the variable, arguments winning over them; the table in
docs/configuration.md is current; ``trainvitals run`` sets them and the start-up shim
for the job without importing torch itself."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.run_configure._helpers import job_env, trainvitals
from trainvitals.hooks import attach
from trainvitals.hooks.config import ATTACH_ENV, Config, EnvError, attach_env, env_name
from trainvitals.hooks.env_reference import REGENERATE, reference_markdown

ROOT = Path(__file__).resolve().parents[2]

# One usable value per Config field, as text, and what it must parse to. A new field
# fails test_every_option_has_a_variable until it gets a line here.
SAMPLES = {
    "every": ("25", 25),
    "loss_reduction": ("sum", "sum"),
    "loss_normalization": ("sqrt", "sqrt"),
    "loss_scale": ("none", None),
    "probe_every": ("50", 50),
    "drift_window": ("20", 20),
    "per_param": ("yes", True),
    "max_param_series": ("64", 64),
    "update_sample": ("1024", 1024),
    "softmax_target": ("0.6", 0.6),
    "softmax_max_positions": ("128", 128),
    "softmax_chunk_bytes": ("1048576", 1048576),
    "loss_from_logits": ("lm_head", "lm_head"),
    "logits_max_positions": ("64", 64),
    "packing_probe_every": ("none", None),
    "step_boundary": ("manual", "manual"),
    "signals": ("params, adam", ("params", "adam")),
    "flush_timeout": ("2.5", 2.5),
    "queue_bytes": ("4096", 4096),
}


def test_every_option_has_a_variable():
    assert sorted(SAMPLES) == sorted(Config.field_names())


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_each_variable_parses_with_its_fields_type(name):
    raw, expected = SAMPLES[name]
    assert Config.from_env({env_name(name): raw}) == {name: expected}


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"TRAINVITALS_EVERY": "ten"}, "TRAINVITALS_EVERY='ten': not an integer"),
        ({"TRAINVITALS_EVERY": "0"}, "TRAINVITALS_EVERY: every must be a positive integer"),
        ({"TRAINVITALS_PER_PARAM": "maybe"}, "TRAINVITALS_PER_PARAM='maybe': not a boolean"),
        ({"TRAINVITALS_LOSS_REDUCTION": "avg"}, "TRAINVITALS_LOSS_REDUCTION='avg': choose one of mean, sum"),
        ({"TRAINVITALS_SOFTMAX_TARGET": "high"}, "TRAINVITALS_SOFTMAX_TARGET='high': not a number"),
        ({"TRAINVITALS_SIGNALS": "params,grads"}, "TRAINVITALS_SIGNALS: signals: unknown ['grads']"),
        ({"TRAINVITALS_LOSS_SCALE": "4"}, "TRAINVITALS_LOSS_SCALE: loss_scale applies only with loss_reduction='sum'"),
    ],
)
def test_a_bad_variable_is_refused_naming_it(env, message):
    with pytest.raises(EnvError) as err:
        Config.from_env(env)
    assert message in str(err.value)


def test_empty_variables_are_unset_and_signals_spell_all_and_none():
    assert Config.from_env({"TRAINVITALS_EVERY": "  ", "TRAINVITALS_PER_PARAM": ""}) == {}
    assert Config.from_env({"TRAINVITALS_SIGNALS": "all"}) == {"signals": None}
    assert Config.from_env({"TRAINVITALS_SIGNALS": "none"}) == {"signals": ()}
    assert Config.from_env({"TRAINVITALS_LOSS_FROM_LOGITS": "true"}) == {"loss_from_logits": True}
    assert attach_env(
        {"TRAINVITALS_MODALITIES": "text, image", "TRAINVITALS_LOCAL_RULES": "default", "TRAINVITALS_RUN": "r"}
    ) == {"modalities": ("text", "image"), "rules": "default", "run": "r"}


def _model_and_optimizer():
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_attach_takes_what_is_not_passed_from_the_environment(monkeypatch):
    monkeypatch.setenv("TRAINVITALS_RUN", "from-env")
    monkeypatch.setenv("TRAINVITALS_EVERY", "7")
    monkeypatch.setenv("TRAINVITALS_PER_PARAM", "true")
    monkeypatch.setenv("TRAINVITALS_MODALITIES", "text,image")
    monkeypatch.setenv("TRAINVITALS_LOCAL_RULES", "default")
    model, opt = _model_and_optimizer()
    with attach(model, opt, sink="null") as mon:
        assert (mon.run, mon.config.every, mon.config.per_param) == ("from-env", 7, True)
        assert mon.modalities == ("text", "image")
        assert mon._sender.on_report is not None  # in-process rules on
    # Arguments win over the environment.
    with attach(model, opt, run="mine", sink="null", every=3, per_param=False, modalities=("a",)) as mon:
        assert (mon.run, mon.config.every, mon.config.per_param, mon.modalities) == ("mine", 3, False, ("a",))


def test_attach_refuses_a_bad_variable_naming_it_and_needs_a_run(monkeypatch):
    model, opt = _model_and_optimizer()
    with pytest.raises(TypeError, match="TRAINVITALS_RUN"):
        attach(model, opt, sink="null")
    monkeypatch.setenv("TRAINVITALS_RUN", "bad name")
    with pytest.raises(ValueError, match="TRAINVITALS_RUN='bad name'"):
        attach(model, opt, sink="null")
    monkeypatch.setenv("TRAINVITALS_RUN", "ok")
    monkeypatch.setenv("TRAINVITALS_DRIFT_WINDOW", "-2")
    with pytest.raises(ValueError, match="TRAINVITALS_DRIFT_WINDOW: drift_window must be a positive integer"):
        attach(model, opt, sink="null")


def test_configuration_doc_is_current():
    doc = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert doc == reference_markdown(), f"docs/configuration.md is out of date; run: {REGENERATE}"
    for name in Config.field_names():
        assert f"`{env_name(name)}`" in doc
    for var in ATTACH_ENV.values():
        assert f"`{var}`" in doc


# -- trainvitals run's launcher ---------------------------------------------------------
LAUNCH = textwrap.dedent("""\
    import json, os, sys
    from trainvitals.monitor.cli import main

    def execvpe(file, args, env):  # stands in for the exec: report what the job would get
        print(json.dumps({"torch": "torch" in sys.modules, "args": args,
                          "env": {k: v for k, v in env.items() if k.startswith(("TRAINVITALS_", "PYTHONPATH"))}}))
        sys.exit(0)

    os.execvpe = execvpe
    main(sys.argv[1:])
    """)


def _launch(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", LAUNCH, "run", *args],
        capture_output=True,
        text=True,
        env=job_env(PYTHONPATH="/elsewhere", **env),
        timeout=60,
    )


def test_run_sets_the_variables_and_the_shim_without_importing_torch():
    import json

    proc = _launch(
        "--run",
        "r1",
        "--collector",
        "http://127.0.0.1:1",
        "--every",
        "4",
        "--set",
        "per-param=1",
        "--",
        "python",
        "train.py",
        "--lr",
        "3",
        TRAINVITALS_DRIFT_WINDOW="9",
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    assert seen["torch"] is False  # checked the variables with hooks/config.py alone
    assert seen["args"] == ["python", "train.py", "--lr", "3"]
    env = seen["env"]
    shim, rest = env["PYTHONPATH"].split(os.pathsep)
    assert Path(shim, "sitecustomize.py").is_file() and rest == "/elsewhere"
    assert {k: env[k] for k in env if k != "PYTHONPATH"} == {
        "TRAINVITALS_RUN": "r1",
        "TRAINVITALS_COLLECTOR": "http://127.0.0.1:1",
        "TRAINVITALS_EVERY": "4",
        "TRAINVITALS_PER_PARAM": "1",
        "TRAINVITALS_DRIFT_WINDOW": "9",
    }
    # Without --run: the script's name and the time, the same for every rank it starts.
    seen = json.loads(_launch("--", "torchrun", "--nproc-per-node", "2", "pretrain.py").stdout)
    assert seen["env"]["TRAINVITALS_RUN"].startswith("pretrain-20")


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (("--set", "per_param=maybe"), {}, "TRAINVITALS_PER_PARAM='maybe': not a boolean"),
        ((), {"TRAINVITALS_EVERY": "0"}, "TRAINVITALS_EVERY: every must be a positive integer"),
        (("--set", "colour=blue"), {}, "--set 'colour=blue': use OPTION=VALUE with OPTION one of every"),
        (("--run", "a b"), {}, "run name 'a b'"),
        (("--collector", "127.0.0.1:9477"), {}, "collector '127.0.0.1:9477': use an http(s) URL"),
    ],
)
def test_run_refuses_bad_settings_before_the_job_starts(args, env, message):
    proc = _launch(*args, "--", "python", "train.py", **env)
    assert proc.returncode == 1 and proc.stdout == "", proc.stdout
    assert message in proc.stderr


def test_a_job_that_never_imports_torch_pays_nothing():
    proc = trainvitals(
        "run",
        "--every",
        "3",
        "--collector",
        "null",
        "--",
        sys.executable,
        "-c",
        "import os, sys; print(os.environ['TRAINVITALS_EVERY'], 'torch' in sys.modules)",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["3", "False"]


def test_pyproject_ships_the_shim():
    # The shim folder is package data of trainvitals.hooks (not a package): the wheel must
    # carry it (tests/test_packaging.py builds one; this is the cheap check of the line).
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    section = text.split("[tool.setuptools.package-data]", 1)[1].split("\n[", 1)[0]
    assert '"trainvitals.hooks" = ["_sitecustomize/sitecustomize.py"]' in section
    assert (ROOT / "hooks" / "_sitecustomize" / "sitecustomize.py").is_file()


def test_every_field_of_config_is_a_documented_field():
    from trainvitals.hooks.env_reference import field_docs

    docs = field_docs()
    assert all(docs.get(f.name) for f in fields(Config)), sorted(set(Config.field_names()) - set(docs))
