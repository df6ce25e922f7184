"""Process groups spawned once that run many cases: what ``zerobridge compare``, the tests and the benchmarks run on.

:mod:`zerobridge.harness.cluster` starts ``world_size`` worker programs
once, initialises ``torch.distributed`` in each and then runs any number of
``"package.module:function"`` targets in them. :mod:`zerobridge.harness.probes`
holds small targets for checking that a cluster works.
"""
