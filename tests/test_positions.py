"""The shared column-index rows the step reads (spec_adapt.positions)."""

import torch

from spec_adapt.positions import offsets


def test_offsets_are_the_column_indices_shared_between_calls():
    row = offsets(5, "cpu")
    assert row.shape == (1, 5) and row.dtype == torch.long and row.tolist() == [[0, 1, 2, 3, 4]]
    assert offsets(5, torch.device("cpu")) is row          # one tensor per (width, device)
    assert offsets(0, "cpu").shape == (1, 0)


def test_offsets_made_in_inference_mode_serve_outside_it():
    with torch.inference_mode():
        row = offsets(913, "cpu")      # a width nothing else asks for: made here
    assert not row.is_inference()
    lengths = torch.tensor([3, 0, 913])
    assert (row < lengths[:, None]).sum(dim=1).tolist() == [3, 0, 913]
