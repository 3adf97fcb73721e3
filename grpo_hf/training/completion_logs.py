"""The completions table (`log_completions`), as TRL keeps it.

The latest generation round's completions from every process become rows: the step they are
logged at, prompt, completion, each reward function's reward (None where it does not apply), the
weighted `reward`, the `advantage`, then the columns reward functions logged with `log_extra`. At
each log the main process (`CompletionLog.flush`):
- prints `num_completions_to_print` rows drawn at random (None: all);
- sends the table to wandb when it is a reporter (`log_unique_prompts`: one row per prompt there);
- writes every row to `<output_dir>/_completions/completions_<step>.parquet` (TRL writes them to
  `completions/`, which `push_to_hub` then uploads with the model; a `_` folder it leaves out:
  `log_completions_hub_repo` is the way to publish them);
- with `log_completions_hub_repo`, uploads the new files to that Hub dataset repo on a helper
  thread, at most one upload at a time and one every `UPLOAD_EVERY` seconds, and the rest when
  training ends (`finish`). The repo is created when the trainer is built, so a wrong name or a
  missing login fails first. huggingface_hub's HTTP calls have no timeout of their own: each call
  here is abandoned after `HUB_TIMEOUT` seconds (creating the repo: an error; an upload: a warning,
  its files go up with the next one, as they stay on disk).
"""

import logging
import math
import os
import random
import threading
import time

import pyarrow
import torch
from accelerate.utils import gather_object
from pyarrow import parquet
from transformers import TrainerCallback

from grpo_hf.algorithm.advantages import combine_rewards
from grpo_hf.config.grpo_config import GRPOConfig
from grpo_hf.data.calls import call_with_timeout
from grpo_hf.data.rollout import ScoredRound, message_text, transcript

logger = logging.getLogger(__name__)

HUB_TIMEOUT = 60.0  # seconds one Hub call may take
UPLOAD_EVERY = 120.0  # seconds between uploads (TRL's CommitScheduler: every 2 minutes)


def completion_rows(
    scored: ScoredRound, reward_names: list[str], weights: torch.Tensor, advantages: torch.Tensor
) -> list[dict]:
    """One row per completion of this process's `scored` rows (advantages (B,)), all with the same
    columns."""
    extra_columns = list(dict.fromkeys(column for row in scored.extra_rows for column in row))
    rewards = combine_rewards(scored.rewards_per_func, weights.to(advantages.device)).tolist()  # (B,)
    per_func = scored.rewards_per_func.tolist()  # (B, F)
    rows = []
    for i, (prompt, completion) in enumerate(zip(scored.prompts, scored.completions, strict=True)):
        row = {"prompt": message_text(prompt), "completion": transcript(completion)}
        row |= {name: _number(value) for name, value in zip(reward_names, per_func[i], strict=True)}
        row |= {"reward": _number(rewards[i]), "advantage": advantages[i].item()}
        row |= {column: scored.extra_rows[i].get(column) for column in extra_columns}  # plain (`cell_value`)
        rows.append(row)
    return rows


def _number(value: float) -> float | None:
    return None if math.isnan(value) else value


def uniform_columns(rows: list[dict]) -> list[dict]:
    """Rows of several processes with every column in each (None where a row lacks it)."""
    columns = list(dict.fromkeys(column for row in rows for column in row))
    return [{column: row.get(column) for column in columns} for row in rows]


def unique_prompt_rows(rows: list[dict]) -> list[dict]:
    """The first row of each prompt."""
    first = {}
    for row in rows:
        first.setdefault(row["prompt"], row)
    return list(first.values())


def print_rows(rows: list[dict], count: int | None, step: int) -> None:
    """Print `count` rows drawn at random (seeded by the step; None: all), in table order."""
    if count is not None and count < len(rows):
        rows = [rows[i] for i in sorted(random.Random(step).sample(range(len(rows)), count))]
    lines = [f"completions at step {step}:"]
    for row in rows:
        reward = "  none" if row["reward"] is None else f"{row['reward']:+.2f}"
        rest = {
            k: v for k, v in row.items() if k not in ("step", "prompt", "completion", "reward", "advantage")
        }
        lines.append(
            f"  [{reward} | advantage {row['advantage']:+.2f}] {row['prompt'][-60:]!r} -> "
            f"{row['completion'][:120]!r}" + (f" {rest}" if rest else "")
        )
    print("\n".join(lines))


def write_parquet(rows: list[dict], folder: str, step: int) -> None:
    """Write the rows to `<folder>/completions_<step>.parquet` (TRL's file name), with pyarrow (a
    dependency of datasets) rather than `Dataset.to_parquet`, which draws a progress bar each time."""
    os.makedirs(folder, exist_ok=True)
    parquet.write_table(
        pyarrow.Table.from_pylist(rows), os.path.join(folder, f"completions_{step:05d}.parquet")
    )


def log_to_wandb(rows: list[dict]) -> None:
    """The rows as a wandb table, if a wandb run is active."""
    import wandb

    if wandb.run is not None:
        table = wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])
        wandb.log({"completions": table}, commit=False)


class HubUploader:
    """Uploads the completion files of `folder` to a Hub dataset repo (see the module)."""

    def __init__(self, repo_id: str, folder: str, private: bool | None, api: object | None = None):
        """Create (or find) the dataset repo `repo_id`; `api` stands in for `huggingface_hub.HfApi()`."""
        from huggingface_hub import HfApi

        self.api = HfApi() if api is None else api
        self.folder = folder
        self.uploaded: set[str] = set()
        self._thread: threading.Thread | None = None
        self._last_start = -math.inf
        try:
            url = call_with_timeout(
                lambda: self.api.create_repo(repo_id, repo_type="dataset", private=private, exist_ok=True),
                HUB_TIMEOUT,
                f"creating the Hub dataset repo {repo_id!r}",
            )
        except Exception as err:
            raise RuntimeError(
                f"log_completions_hub_repo={repo_id!r}: could not create or reach that Hub dataset repo "
                f"({type(err).__name__}: {err}). Log in (`hf auth login`, or set HF_TOKEN), check the repo "
                "name, or unset log_completions_hub_repo."
            ) from err
        self.repo_id = getattr(url, "repo_id", None) or repo_id  # "name" alone: created under the user

    def upload(self, force: bool = False) -> None:
        """Start uploading the files not uploaded yet, unless an upload is running or (without
        `force`) the last one started less than UPLOAD_EVERY seconds ago."""
        if self._thread is not None and self._thread.is_alive():
            return
        if not force and time.monotonic() - self._last_start < UPLOAD_EVERY:
            return
        files = sorted(
            f for f in os.listdir(self.folder) if f.endswith(".parquet") and f not in self.uploaded
        )
        if not files:
            return
        self._last_start = time.monotonic()
        self._thread = threading.Thread(
            target=self._upload, args=(files,), daemon=True, name="completions-hub"
        )
        self._thread.start()

    def _upload(self, files: list[str]) -> None:
        try:
            call_with_timeout(
                lambda: self.api.upload_folder(
                    repo_id=self.repo_id,
                    repo_type="dataset",
                    folder_path=self.folder,
                    allow_patterns=files,
                    commit_message=f"Add {len(files)} completion files",
                ),
                HUB_TIMEOUT,
                f"uploading {len(files)} completion files",
            )
            self.uploaded.update(files)
        except Exception as err:
            logger.warning(
                "Uploading %d completion files to the Hub dataset repo %s failed (%s: %s); they stay in %s and "
                "go up with the next upload.",
                len(files),
                self.repo_id,
                type(err).__name__,
                err,
                self.folder,
            )

    def finish(self) -> None:
        """Upload what is left (waiting for a running upload first), each wait bounded by HUB_TIMEOUT."""
        if self._thread is not None:  # a running upload (call_with_timeout bounds it)
            self._thread.join(HUB_TIMEOUT + 1)
        self.upload(force=True)
        if self._thread is not None:
            self._thread.join(HUB_TIMEOUT + 1)
        left = [f for f in os.listdir(self.folder) if f.endswith(".parquet") and f not in self.uploaded]
        if left:
            logger.warning(
                "%d completion files did not reach the Hub dataset repo %s; they are in %s.",
                len(left),
                self.repo_id,
                self.folder,
            )


class CompletionLog(TrainerCallback):
    """The trainer's completions table: the latest round's rows until the next log (see the module)."""

    def __init__(self, args: GRPOConfig, is_main_process: bool):
        self.args = args
        self.rows: list[dict] = []
        self.folder = os.path.join(args.output_dir, "_completions")  # '_': push_to_hub leaves it out
        self.uploader = None
        if is_main_process and args.log_completions and args.log_completions_hub_repo is not None:
            self.uploader = HubUploader(args.log_completions_hub_repo, self.folder, args.hub_private_repo)

    def record(self, rows: list[dict]) -> None:
        """Keep every process's rows of a round (replacing the previous round's); every process calls it."""
        self.rows = uniform_columns(gather_object(rows))

    def flush(self, step: int) -> None:
        """Print, send to wandb, write and upload the rows (main process), then forget them."""
        if not self.rows:
            return
        rows, self.rows = [{"step": step} | row for row in self.rows], []  # the step logged, as TRL
        print_rows(rows, self.args.num_completions_to_print, step)
        if "wandb" in self.args.report_to:
            log_to_wandb(unique_prompt_rows(rows) if self.args.log_unique_prompts else rows)
        write_parquet(rows, self.folder, step)
        if self.uploader is not None:
            self.uploader.upload()

    def on_train_end(self, args, state, control, **kwargs):
        if self.uploader is not None:
            self.uploader.finish()
