"""Hand-written kernels of the emitted program, one per module, each a ``torch.library.custom_op`` with a
fake kernel, a torch path (any device) and a Triton path on GPU (issue 12). Import a kernel's module to
register its op."""
