"""plait eval over every kept checkpoint: the curve as a table and as a plot."""

from __future__ import annotations

from plait.views.common import console, pyplot


def table(curve: list[dict], best: int) -> None:
    from rich.table import Table

    t = Table(title="loss by checkpoint", title_justify="left")
    for name in ("step", "loss", "perplexity", ""):
        t.add_column(name, justify="right")
    for c in curve:
        t.add_row(str(c["step"]), f"{c['loss']:.4f}", f"{c['perplexity']:,.3f}",
                  "best" if c["step"] == best else "")
    console().print(t)


def draw(curve: list[dict], title: str, path: str) -> None:
    """Loss against the step of each checkpoint, the best one marked."""
    plt = pyplot()
    steps, losses = [c["step"] for c in curve], [c["loss"] for c in curve]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot(steps, losses, marker="o")
    i = losses.index(min(losses))
    ax.annotate(f"best: step {steps[i]}, {losses[i]:.4f}", (steps[i], losses[i]),
                textcoords="offset points", xytext=(0, 10), ha="center", fontsize=8)
    ax.set_xlabel("checkpoint step")
    ax.set_ylabel("mean loss (nats per token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
