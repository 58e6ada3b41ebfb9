"""`padded_prompt`: one prompt padded to the next multiple of the bucket, never narrower than one."""

import numpy as np
import pytest

from specjax.core.sequence import padded_prompt, prompt_width


@pytest.mark.parametrize("length, width", [(1, 32), (31, 32), (32, 32), (33, 64), (146, 160)])
def test_the_width_is_the_next_multiple(length, width):
  assert prompt_width(length) == width
  tokens, lengths = padded_prompt(list(range(1, length + 1)), pad_id=-1)
  assert tokens.shape == (1, width) and tokens.dtype == np.int32
  assert lengths.tolist() == [length] and lengths.dtype == np.int32
  assert tokens[0, :length].tolist() == list(range(1, length + 1))
  assert (tokens[0, length:] == -1).all()


def test_another_multiple():
  assert [prompt_width(n, 8) for n in (1, 8, 9, 16, 17)] == [8, 8, 16, 16, 24]
