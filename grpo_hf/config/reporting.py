"""`report_to` checked when the config is made, before any model is loaded: a reporting integration
that cannot start fails here, in the first seconds, not when training begins minutes later.

- A name transformers does not know: an error listing the names it knows.
- An integration whose package is missing (transformers' own availability check; comet_ml's is
  whether it is installed, the API key being optional offline): an error naming `report_to` and the
  `pip install`.
- wandb without credentials (`WANDB_API_KEY`, `WANDB_IDENTITY_TOKEN_FILE`, or the netrc entry
  `wandb login` writes for `WANDB_BASE_URL`'s host) and without a terminal or notebook to ask for
  them, where wandb would stop the run with "No API key configured" when training starts: the run
  logs offline (`WANDB_MODE=offline` in this process), one line saying so and how to upload it
  later. The fallback rather than an error because the user asked for a run, and an offline run
  keeps every logged value for `wandb sync`. `WANDB_MODE=online` set by the user is a wish for an
  online run: there the same case is an error. `WANDB_MODE` offline / dryrun / disabled: nothing
  to check.
"""

import importlib.util
import logging
import netrc
import os
import sys
from collections.abc import Callable
from urllib.parse import urlsplit

from transformers import integrations

logger = logging.getLogger(__name__)

# What each integration needs, as transformers checks it, and how to get it.
REQUIREMENTS: dict[str, tuple[Callable[[], bool], str]] = {
    "azure_ml": (integrations.is_azureml_available, "pip install azureml-core"),
    "clearml": (integrations.is_clearml_available, "pip install clearml"),
    "codecarbon": (integrations.is_codecarbon_available, "pip install codecarbon"),
    "comet_ml": (lambda: importlib.util.find_spec("comet_ml") is not None, "pip install comet-ml"),
    "dagshub": (integrations.is_dagshub_available, "pip install dagshub mlflow"),
    "dvclive": (integrations.is_dvclive_available, "pip install dvclive"),
    "flyte": (integrations.is_flytekit_available, "pip install flytekit"),
    "kubeflow": (
        integrations.is_kubeflow_available,
        "run inside a Kubeflow TrainJob, which sets KUBEFLOW_TRAINER_SERVER_URL",
    ),
    "mlflow": (integrations.is_mlflow_available, "pip install mlflow (and unset DISABLE_MLFLOW_INTEGRATION)"),
    "neptune": (integrations.is_neptune_available, "pip install neptune"),
    "swanlab": (integrations.is_swanlab_available, "pip install swanlab"),
    "tensorboard": (integrations.is_tensorboard_available, "pip install tensorboard"),
    "trackio": (integrations.is_trackio_available, "pip install trackio"),
    "wandb": (integrations.is_wandb_available, "pip install wandb"),
}
WANDB_OFFLINE_MODES = ("offline", "dryrun", "disabled")


def check_report_to(report_to: list[str], main_process: bool) -> None:
    """Errors for integrations in `report_to` that cannot start; wandb's offline fallback (the line
    logged on the main process only)."""
    for name in report_to:
        if name not in integrations.INTEGRATION_TO_CALLBACK:
            raise ValueError(
                f"report_to={name!r} is not a reporting integration transformers knows; use some of "
                f"{sorted(integrations.INTEGRATION_TO_CALLBACK)}, or report_to none."
            )
        available, advice = REQUIREMENTS.get(name, (lambda: True, ""))
        if not available():
            raise ValueError(
                f"report_to names {name!r}, which cannot start here: {advice}; or take {name!r} out of "
                "report_to (report_to none logs nowhere)."
            )
    if "wandb" in report_to:
        check_wandb_login(main_process)


def check_wandb_login(main_process: bool) -> None:
    """wandb logs offline where it has no credentials and no terminal to ask for them (module docstring)."""
    mode = os.environ.get("WANDB_MODE", "").lower()
    if mode in WANDB_OFFLINE_MODES or wandb_credentials() or can_prompt():
        return
    sync = f"wandb sync {os.path.join(os.environ.get('WANDB_DIR', '.'), 'wandb', 'offline-run-*')}"
    if mode:
        raise ValueError(
            f"report_to names 'wandb' and WANDB_MODE={mode}, but wandb has no API key here and no terminal to "
            "ask for one: run `wandb login` or set WANDB_API_KEY; or set WANDB_MODE=offline and upload the "
            f"run afterwards with `{sync}`; or take 'wandb' out of report_to."
        )
    os.environ["WANDB_MODE"] = "offline"
    if main_process:
        logger.warning(
            "report_to wandb: no wandb API key here (WANDB_API_KEY, `wandb login`) and no terminal to ask for "
            f"one, so this run logs offline (WANDB_MODE=offline); upload it afterwards with `wandb login` "
            f"and `{sync}`."
        )


def wandb_credentials() -> bool:
    """Whether wandb finds credentials without asking: WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE, or a
    netrc entry (NETRC, else ~/.netrc) for the wandb host."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).netloc
    try:
        entries = netrc.netrc(os.environ.get("NETRC") or os.path.expanduser("~/.netrc"))
    except (OSError, netrc.NetrcParseError):  # no file, or one wandb could not read either
        return False
    return entries.authenticators(host) is not None


def can_prompt() -> bool:
    """Whether wandb can ask for a key: a terminal on stdin and stderr (wandb's test), or a notebook."""
    terminal = all(stream is not None and stream.isatty() for stream in (sys.stdin, sys.stderr))
    return terminal or "ipykernel" in sys.modules
