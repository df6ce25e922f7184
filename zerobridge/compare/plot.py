"""A PNG of a comparison: loss curves, memory bars and communication bars.

Needs matplotlib (``pip install 'zerobridge[plot]'``); without it
``write_plot`` raises ``ConfigError`` naming that install, before any run
starts when ``zerobridge compare --plot`` checks with ``require_matplotlib``.
"""

from __future__ import annotations

from pathlib import Path

from zerobridge.checkpoint.storage import atomic_write_file
from zerobridge.compare.report import Comparison, display_name
from zerobridge.errors import ConfigError

__all__ = ["require_matplotlib", "write_plot"]

_MIB = 2**20


def require_matplotlib(target: Path) -> None:
    """Raise ``ConfigError`` when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("--plot needs matplotlib, which is not installed", source=str(target), key="--plot",
                          fix="pip install 'zerobridge[plot]' (or matplotlib), or drop --plot") from None


def write_plot(comparison: Comparison, target: Path) -> Path:
    """Draw ``comparison`` into ``target`` (PNG), atomically."""
    require_matplotlib(target)
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    done = [r for r in comparison.runs if r.error is None]
    names = [display_name(r) for r in done]
    fig, (curves, memory, comm) = plt.subplots(1, 3, figsize=(17, 5.2), gridspec_kw={"width_ratios": [1.2, 1, 1]})
    for index, run in enumerate(done):
        approximate = " (approximated)" if run.planned.approximations else ""
        curves.plot(range(len(run.losses)), run.losses, label=run.planned.name + approximate, linewidth=1.4,
                    linestyle=("-", "--", ":", "-.")[index % 4])
    curves.set(title=f"loss (max deviation {comparison.max_deviation():.1e})", xlabel="step", ylabel="loss")
    curves.legend(fontsize=7)

    positions = range(len(done))
    bottom = [0.0] * len(done)
    for part in ("params", "grads", "optimizer"):
        values = [r.model_state_bytes.get(part, 0) / _MIB for r in done]
        memory.bar(positions, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    formula = [(i, r.formula_model_state_bytes / _MIB) for i, r in enumerate(done) if r.formula_model_state_bytes]
    if formula:
        stages = sorted({r.planned.formula_stage for r in done if r.planned.formula_stage is not None})
        against = "ZeRO formula" + (f" (~ runs: ZeRO-{'/'.join(map(str, stages))})" if stages else "")
        memory.scatter([i for i, _ in formula], [v for _, v in formula], marker="_", s=400, color="black",
                       label=against, zorder=3)
    memory.set(title="model state per rank (MiB)", ylabel="MiB")
    memory.set_xticks(list(positions), names, rotation=60, ha="right", fontsize=7)
    memory.legend(fontsize=7)

    kinds = sorted({k for r in done for k in r.comm_bytes})
    bottom = [0.0] * len(done)
    for kind in kinds:
        values = [r.comm_bytes.get(kind, 0.0) / _MIB for r in done]
        comm.bar(positions, values, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, values)]
    comm.set(title="communication per step per rank (MiB, bus volume)", ylabel="MiB")
    comm.set_xticks(list(positions), names, rotation=60, ha="right", fontsize=7)
    if kinds:
        comm.legend(fontsize=7)
    fig.suptitle(f"{comparison.model}: {comparison.params:,} parameters, world {comparison.world_size}, "
                 f"{comparison.steps} steps — {comparison.status.upper()}")
    fig.tight_layout()
    try:
        atomic_write_file(target, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    finally:
        plt.close(fig)
    return target
