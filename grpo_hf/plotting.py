"""A PNG of reward, KL and completion length against optimizer step, from the Trainer's log history."""

import matplotlib

matplotlib.use("Agg")  # headless: no display on training machines
import matplotlib.pyplot as plt  # noqa: E402

PANELS = (
    ("reward", "reward (sampled)"),
    ("kl", "KL to reference"),
    ("completions/mean_length", "completion length"),
)


def plot_training(log_history: list[dict], path: str) -> str:
    """Plot the logged GRPO metrics that exist in `log_history`; return the file path."""
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 3.2))
    for ax, (key, title) in zip(axes, PANELS, strict=True):
        points = [(row["step"], row[key]) for row in log_history if key in row and "step" in row]
        if points:
            steps, values = zip(*points, strict=True)
            ax.plot(steps, values, marker="o", markersize=3)
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
