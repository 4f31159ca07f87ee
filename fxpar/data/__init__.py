"""Data for fine-tuning: tokenizers from model directories, local files through HF datasets, packing or padding, a deterministic resumable order."""
