"""What the tests and benchmarks run on every rank of a process group: workloads, reference runs, probes.

Internal: these modules are workers for ``tests/`` and ``bench/`` (each a
``"zerobridge.testing.<module>:<function>"`` target a
``zerobridge.harness.cluster.Cluster`` runs), not an API. Product code never
imports them; ``zerobridge compare --model`` may name
``zerobridge.testing.workloads`` factories as examples.
"""
