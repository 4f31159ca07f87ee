"""The report reads a compiled model only through its typed record (``compiled.view()``,
:class:`fxpar.ir.rank_view.RankView`): an object offering nothing but ``view()`` gives the same report,
text and JSON, as the priced model itself."""

import torch

import fxpar
from fxpar import zoo
from fxpar.api import price
from fxpar.ir.rank_view import RankView
from fxpar.report.budget import communication, trainable


class OnlyView:
    """A stand-in that has no attribute of a compiled model but ``view()``."""

    def __init__(self, view: RankView):
        self._view = view

    def view(self) -> RankView:
        return self._view


def test_the_report_of_a_priced_plan_needs_only_its_view():
    batch = zoo.example_inputs("llama", zoo.tiny_config("llama"), batch=2, seq=4)
    priced = price(zoo.build("llama", num_hidden_layers=1), "dp=2,tp=2,zero=1", example_kwargs=batch, rank=3,
                   optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    view = priced.view()
    assert isinstance(view, RankView) and view.data_parallel is not None and view.data_parallel.buckets
    assert (view.pp_rank, view.replicas, view.microbatches) == (priced.spec.pp_rank, 2, priced.setup.microbatches)
    whole, alone = fxpar.inspect(priced, quiet=True), fxpar.inspect(OnlyView(view), quiet=True)
    assert alone.to_text() == whole.to_text()
    assert alone.to_json() == whole.to_json()
    assert "data parallel: dp=2, ZeRO-1" in whole.to_text() and whole.tp_coverage() is not None
    assert trainable(OnlyView(view)) == trainable(priced) and communication(view) == communication(priced)
