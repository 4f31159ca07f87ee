"""Data for fine-tuning: tokenizers from model directories, local files through HF datasets, packing or padding, a
deterministic resumable order.

``load_tokenizer(dir)`` -> ``DataSpec(path, ...)`` -> ``TokenDataset(spec, tok, max_positions=...)`` ->
``Batches(ds, batch, seed)`` for training (``state_dict`` in the checkpoint) and ``eval_batches(ds, batch)``
for evaluation. ``datasets`` and ``transformers`` are imported only when a file or tokenizer is read.

Large files are streamed instead (:mod:`fxpar.data.streamed`): ``use_streaming(spec, mode)`` ->
``StreamedDataset(spec, tok, ...)`` -> ``StreamedBatches(ds, batch, seed)``: each rank reads and
tokenizes only its share of the file, and every rank gets the same global batches.
"""

from fxpar.data.batches import Batches, eval_batches
from fxpar.data.dataset import TokenDataset
from fxpar.data.encode import IGNORE
from fxpar.data.spec import DataSpec
from fxpar.data.streamed import StreamedBatches, StreamedDataset, use_streaming
from fxpar.data.tokenizer import load_tokenizer

__all__ = ["Batches", "DataSpec", "IGNORE", "StreamedBatches", "StreamedDataset", "TokenDataset", "eval_batches",
           "load_tokenizer", "use_streaming"]
