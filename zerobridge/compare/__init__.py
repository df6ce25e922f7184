"""Train the same model on several ZeRO stages and backends and prove they agree.

    >>> from zerobridge.compare import plan
    >>> p = plan(stages=[1, 3], backends=["native", "fsdp", "deepspeed"], nproc=2, steps=3)
    >>> [r.name for r in p.runs]
    ['native/stage1', 'fsdp/stage1', 'deepspeed/stage1', 'native/stage3', 'fsdp/stage3', 'deepspeed/stage3']
    >>> [r.name for r in p.runs if r.approximations]  # FSDP2's closest form of ZeRO-1, marked ~
    ['fsdp/stage1']
    >>> [(s.backend, s.label) for s in plan(stages=[1], exact_only=True).comparison.skipped]
    [('fsdp', 'stage1')]

``compare(...)`` runs such a plan (each run in a fresh process group) and
returns a ``Comparison``: ``ok``, ``divergences``, ``render()``,
``markdown()``, ``to_json()``. From the shell::

    zerobridge compare                                    # tiny GPT, 2 processes, stages 0-3 x 3 backends
    zerobridge compare --stages 3 --backends native fsdp --steps 50 --json out.json
    zerobridge compare --config ds_zero2.json accelerate_fsdp.yaml --markdown "$GITHUB_STEP_SUMMARY"
    zerobridge compare --model mypkg.bench:workload --tolerance 1e-3 --plot compare.png

Exit codes: 0 all runs agree within the tolerance, 1 a run diverged or
failed (the message names the run and the step), 2 bad input.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Comparison", "Divergence", "Plan", "Planned", "RunOutcome", "Skipped", "Workload", "adamw", "compare",
           "plan", "run_plan", "tiny_gpt_workload"]



def __getattr__(name: str) -> Any:
    # Names load on first use: the ``zerobridge`` command registers ``compare`` without importing torch.
    if name in ("Plan", "compare", "plan", "run_plan"):
        from zerobridge.compare import api  # lazy: loads torch

        return getattr(api, name)
    if name in ("Comparison", "Divergence"):
        from zerobridge.compare import report  # lazy: loads torch

        return getattr(report, name)
    if name in ("Planned", "RunOutcome", "Skipped"):
        from zerobridge.compare import runner  # lazy: loads torch

        return getattr(runner, name)
    if name in ("Workload", "adamw", "tiny_gpt_workload"):
        from zerobridge.compare import workload  # lazy: loads torch

        return getattr(workload, name)
    raise AttributeError(f"module 'zerobridge.compare' has no attribute {name!r}")
