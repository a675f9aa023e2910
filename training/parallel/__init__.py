"""How a model is laid out over processes: the device and process group (`distributed`: `World`), FSDP2, compile
and activation checkpointing (`parallelize`), neuronx-distributed's tensor, sequence and pipeline parallelism
(`neuron`), and the tensor-parallel weight slices that checkpoints and exports share (`tensor_slices`)."""
