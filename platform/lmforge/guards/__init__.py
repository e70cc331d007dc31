"""What keeps a run going through numerical and memory trouble: non-finite steps
and loss spikes (`divergence`), out-of-memory (`oom`), leaked tensors (`leaks`), and
the fault injection that exercises them (`inject`)."""
