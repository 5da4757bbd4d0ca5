#!/usr/bin/env python3
"""Draws train_gpt's metrics (JSON lines from --metrics) as a PNG: training and evaluation loss per step,
and the learning rate on a second axis.

Usage: .venv/bin/python scripts/plot_metrics.py METRICS.jsonl [-o OUT.png] [--title TEXT]
Default output: METRICS with the extension .png. Lines whose loss is null (the evaluation before
training) contribute only their eval_loss.
"""

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt  # noqa: E402


def read_metrics(path):
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                sys.exit(f"plot_metrics: {path}:{n}: not JSON ({e})")
    if not rows:
        sys.exit(f"plot_metrics: {path} holds no metrics lines")
    return rows


def plot(rows, out, title):
    train = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
    evals = [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
    lrs = [(r["step"], r["lr"]) for r in rows if r.get("lr") is not None and r.get("loss") is not None]

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    if train:
        ax.plot(*zip(*train), label="train loss", color="tab:blue", linewidth=1.5)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss", color="tab:orange", linewidth=1.5, markersize=4)
        last_step, last = evals[-1]
        ax.annotate(f"{last:.3f}", (last_step, last), textcoords="offset points", xytext=(-10, 8), fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.grid(True, alpha=0.3)
    if lrs:
        ax2 = ax.twinx()
        ax2.plot(*zip(*lrs), color="tab:gray", linewidth=0.8, alpha=0.6, label="learning rate")
        ax2.set_ylabel("learning rate")
        ax2.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
        handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
        ax.legend(handles, [h.get_label() for h in handles], loc="upper right")
    else:
        ax.legend(loc="upper right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("metrics", type=Path, help="JSON lines written by train_gpt --metrics")
    ap.add_argument("-o", "--output", type=Path, help="PNG to write (default: METRICS with .png)")
    ap.add_argument("--title", default=None, help="plot title (default: the metrics file name)")
    args = ap.parse_args()
    if not args.metrics.is_file():
        sys.exit(f"plot_metrics: {args.metrics} does not exist (write it with train_gpt --metrics FILE)")
    out = args.output or args.metrics.with_suffix(".png")
    rows = read_metrics(args.metrics)
    plot(rows, out, args.title or f"train_gpt: {args.metrics.name}")
    print(out)


if __name__ == "__main__":
    main()
