"""Test and comparison support: a spawned process group that runs many cases.

:mod:`zerobridge.testing.cluster` spawns ``world_size`` worker processes once,
initialises ``torch.distributed`` in each and then runs any number of
``"package.module:function"`` targets in them. :mod:`zerobridge.testing.probes`
holds small targets for checking that a cluster works.
"""
