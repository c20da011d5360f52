"""Settings: defaults, YAML file, environment over file, errors that name the source."""

from __future__ import annotations

import pytest

from trainvitals.monitor.settings import Settings, SettingsError


def test_defaults():
    s = Settings()
    assert (s.host, s.port, s.token, s.run_ttl_seconds) == ("127.0.0.1", 9477, None, 3600)
    assert s.max_body_bytes == 16 * 1024 * 1024
    assert s.max_decompressed_bytes == 64 * 1024 * 1024
    assert s.max_series == 1_000_000
    assert (s.rules, s.alerts, s.notifiers) == (None, None, None)


def test_file_then_env_then_arguments(tmp_path, monkeypatch):
    config = tmp_path / "c.yaml"
    config.write_text(
        "port: 1111\nhost: 0.0.0.0\nrun_ttl_seconds: 60\n"
        "rules: [a.yaml, b.yaml]\n"
        "alerts: {eval: fast}\n"
        "notifiers: [{kind: slack, url: 'http://x'}]\n"
    )
    monkeypatch.setenv("TRAINVITALS_PORT", "2222")
    monkeypatch.setenv("TRAINVITALS_RUN_TTL_SECONDS", "30")
    s = Settings.from_file(config, run_ttl_seconds=None)
    assert (s.host, s.port, s.run_ttl_seconds) == ("0.0.0.0", 2222, 30)
    assert s.rules == ["a.yaml", "b.yaml"]
    assert s.alerts == {"eval": "fast"} and s.notifiers == [{"kind": "slack", "url": "http://x"}]
    assert Settings.from_file(config, port=3333).port == 3333


def test_env_accepts_plain_and_json_values(monkeypatch):
    monkeypatch.setenv("TRAINVITALS_RULES", "rules/custom.yaml")
    assert Settings().rules == "rules/custom.yaml"
    monkeypatch.setenv("TRAINVITALS_RULES", '["a.yaml", "b.yaml"]')
    assert Settings().rules == ["a.yaml", "b.yaml"]


def test_unrelated_trainvitals_env_vars_are_ignored(monkeypatch):
    monkeypatch.setenv("TRAINVITALS_COLLECTOR", "http://127.0.0.1:9477")  # the hooks' variable
    assert Settings().port == 9477


def test_bad_file_names_file_and_field(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("port: high\nmax_seriez: 3\n")
    with pytest.raises(SettingsError) as info:
        Settings.from_file(config)
    msg = str(info.value)
    assert f"{config}: port: Input should be a valid integer" in msg
    assert f"{config}: max_seriez: Extra inputs are not permitted" in msg


def test_bad_env_names_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINVITALS_MAX_SERIES", "lots")
    with pytest.raises(SettingsError, match="environment variable TRAINVITALS_MAX_SERIES: max_series"):
        Settings.from_file(None)


@pytest.mark.parametrize(
    "text, expected",
    [("- a\n- b\n", "expected a mapping of settings, got list"), ("port: [\n", "not valid YAML")],
)
def test_file_that_is_not_a_mapping(tmp_path, text, expected):
    config = tmp_path / "c.yaml"
    config.write_text(text)
    with pytest.raises(SettingsError, match=expected):
        Settings.from_file(config)


def test_missing_file(tmp_path):
    with pytest.raises(SettingsError, match="cannot read config file"):
        Settings.from_file(tmp_path / "nope.yaml")


def test_empty_file_means_defaults(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("")
    assert Settings.from_file(config).port == 9477


def test_token_file_and_secrecy(tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text("  hunter2-token \n")
    s = Settings(token_file=token_file)
    assert s.token.get_secret_value() == "hunter2-token"
    assert "hunter2" not in repr(s) and "hunter2" not in str(s)
    with pytest.raises(ValueError) as info:
        Settings(token="hunter2-token", token_file=token_file)
    assert "not both" in str(info.value) and "hunter2" not in str(info.value)


def test_token_file_argument_replaces_env_token(tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text("from-file")
    monkeypatch.setenv("TRAINVITALS_TOKEN", "from-env")
    assert Settings.from_file(None).token.get_secret_value() == "from-env"
    s = Settings.from_file(None, token_file=token_file)
    assert s.token.get_secret_value() == "from-file"


@pytest.mark.parametrize("content, match", [("", "is empty"), (None, "No such file")])
def test_bad_token_file(tmp_path, content, match):
    token_file = tmp_path / "token"
    if content is not None:
        token_file.write_text(content)
    with pytest.raises(SettingsError, match=match):
        Settings.from_file(None, token_file=token_file)


def test_limits_are_validated():
    with pytest.raises(SettingsError, match="max_body_bytes: Input should be greater than 0"):
        Settings.from_file(None, max_body_bytes=0)


def test_state_is_durable_by_default_in_the_xdg_state_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert Settings().state_path == tmp_path / "trainvitals" / "collector.sqlite3"
    monkeypatch.setenv("XDG_STATE_HOME", "relative/ignored")  # the XDG spec: absolute only
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert Settings().state_path == tmp_path / "home" / ".local" / "state" / "trainvitals" / "collector.sqlite3"


@pytest.mark.parametrize("off", ["memory", "none", "None", "", ":memory:", "off"])
def test_state_path_memory_turns_the_file_off_from_file_env_and_argument(off, tmp_path, monkeypatch):
    config = tmp_path / "c.yaml"
    config.write_text(f"state_path: '{off}'\n")
    assert Settings.from_file(config).state_path is None
    monkeypatch.setenv("TRAINVITALS_STATE_PATH", off)
    assert Settings().state_path is None
    monkeypatch.delenv("TRAINVITALS_STATE_PATH")
    assert Settings(state_path=off).state_path is None
    config.write_text("state_path: null\n")
    assert Settings.from_file(config).state_path is None
    assert Settings.from_file(config, state_path="~/s.db").state_path.name == "s.db"
