"""The command line's models come from the train layer (``fxpar.train.models``)."""

from fxpar.train.models import directory_weights, example_kwargs, load_model, model_directory  # noqa: F401
