"""report_to is checked when the config is made, before any model is loaded (issue 44, item 3): wandb
without credentials and without a terminal logs offline with one line saying how to upload the run;
with a key, a netrc entry, a terminal or WANDB_MODE set, nothing changes (WANDB_MODE=online without a
key: an error); a missing package or an unknown name is an error naming report_to."""

import importlib.util
import io
import logging
import os
import sys

import pytest
from trainer_helpers import make_config
from transformers import integrations

from grpo_hf.config import reporting

WANDB_VARIABLES = ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "WANDB_DIR")


class Stream(io.StringIO):
    """sys.stdin / sys.stderr, a terminal or not."""

    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.fixture
def no_login(monkeypatch, tmp_path):
    """No wandb variable, no netrc file, no terminal; returns a function that gives the terminal back."""
    for name in WANDB_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setattr(sys, "stdin", Stream(tty=False))
    monkeypatch.setattr(sys, "stderr", Stream(tty=False))

    def terminal():
        monkeypatch.setattr(sys, "stdin", Stream(tty=True))
        monkeypatch.setattr(sys, "stderr", Stream(tty=True))

    return terminal


def wandb_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == reporting.__name__]


def test_wandb_without_a_login_or_a_terminal_logs_offline_and_says_how_to_sync(tmp_path, no_login, caplog):
    with caplog.at_level(logging.WARNING, logger=reporting.__name__):
        args = make_config(tmp_path, report_to=["wandb"])
    assert args.report_to == ["wandb"] and os.environ["WANDB_MODE"] == "offline"
    (line,) = wandb_lines(caplog)
    assert "logs offline (WANDB_MODE=offline)" in line
    assert f"wandb sync {os.path.join('.', 'wandb', 'offline-run-*')}" in line and "wandb login" in line


@pytest.mark.parametrize("login", ["api_key", "netrc", "terminal"])
def test_wandb_with_a_key_a_netrc_login_or_a_terminal_is_left_alone(
    tmp_path, no_login, caplog, monkeypatch, login
):
    if login == "api_key":
        monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    elif login == "netrc":  # what `wandb login` writes
        (tmp_path / "netrc").write_text(f"machine api.wandb.ai\n  login user\n  password {'k' * 40}\n")
    else:  # wandb asks for the key itself
        no_login()
    with caplog.at_level(logging.WARNING, logger=reporting.__name__):
        make_config(tmp_path, report_to=["wandb"])
    assert "WANDB_MODE" not in os.environ and wandb_lines(caplog) == []


def test_a_netrc_login_for_another_host_is_no_login(tmp_path, no_login, monkeypatch):
    (tmp_path / "netrc").write_text(f"machine api.wandb.ai\n  login user\n  password {'k' * 40}\n")
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com")
    make_config(tmp_path, report_to=["wandb"])
    assert os.environ["WANDB_MODE"] == "offline"


@pytest.mark.parametrize("mode", ["offline", "disabled"])
def test_wandb_mode_offline_or_disabled_is_left_alone(tmp_path, no_login, caplog, monkeypatch, mode):
    monkeypatch.setenv("WANDB_MODE", mode)
    with caplog.at_level(logging.WARNING, logger=reporting.__name__):
        make_config(tmp_path, report_to=["wandb"])
    assert os.environ["WANDB_MODE"] == mode and wandb_lines(caplog) == []


def test_wandb_mode_online_without_a_login_fails_at_once_saying_what_to_do(tmp_path, no_login, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")
    with pytest.raises(ValueError, match="WANDB_MODE=online") as error:
        make_config(tmp_path, report_to=["wandb"])
    assert "wandb login" in str(error.value) and "WANDB_MODE=offline" in str(error.value)
    assert "wandb sync" in str(error.value) and os.environ["WANDB_MODE"] == "online"


def test_reporting_to_nothing_checks_nothing(tmp_path, no_login):
    make_config(tmp_path, report_to="none")
    assert "WANDB_MODE" not in os.environ


@pytest.mark.parametrize(
    ("name", "modules", "install"),
    [
        ("tensorboard", ("tensorboard", "tensorboardX"), "pip install tensorboard"),
        ("wandb", ("wandb",), "pip install wandb"),
        ("comet_ml", ("comet_ml",), "pip install comet-ml"),
        ("mlflow", ("mlflow",), "pip install mlflow"),
        ("trackio", ("trackio",), "pip install trackio"),
    ],
)
def test_a_missing_package_fails_naming_report_to_and_the_install(
    tmp_path, monkeypatch, name, modules, install
):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m in modules else find_spec(m, *a))
    with pytest.raises(ValueError, match=f"report_to names '{name}'") as error:
        make_config(tmp_path, report_to=["tensorboard", name] if name != "tensorboard" else [name])
    assert install in str(error.value) and "report_to none" in str(error.value)


def test_an_unknown_integration_fails_listing_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="report_to='wandbb' is not a reporting integration") as error:
        make_config(tmp_path, report_to=["wandbb"])
    assert "'tensorboard'" in str(error.value) and "'wandb'" in str(error.value)


def test_every_integration_transformers_knows_has_its_requirement():
    assert set(reporting.REQUIREMENTS) == set(integrations.INTEGRATION_TO_CALLBACK)
