"""Parallelism applied from outside the model: the device mesh and the steps that
shard a plain `nn.Module` over it (FSDP2 today; TP and PP plug in here)."""
