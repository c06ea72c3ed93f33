"""Lightning strategies with each rank's share of every batch from one hetsplit plan, shaped as Lightning's own.

- :mod:`.strategy`: ``HeteroStrategy``, what every hetsplit strategy does (devices, plan,
  rebuilt loaders, step weights, weighted metrics, emulated speed), its hooks marked ``@override``;
- :mod:`.ddp`: ``HeteroDDPStrategy``; :mod:`.model_parallel`: ``HeteroModelParallelStrategy`` (FSDP2);
- :mod:`.micro_batches`: a share run as the plan's micro-batches inside one step;
- :mod:`.checks`, :mod:`.logs`, :mod:`.profiling`: the pieces they use (the callback lives with the strategy).

Users import the strategies from :mod:`hetsplit.lightning`.
"""
