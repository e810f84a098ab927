"""Where a Mosaic GPU register layout puts a warpgroup array's elements, from
the layout's own tiling: the ground truth that in-thread register code
(`common.fp8_operand`, `common.quad_dropout_in_threads`) is checked
against on a CPU."""
from __future__ import annotations

import numpy as np


def element_coordinates(layout, shape) -> dict:
  """{(warp, lane, register index, vector position): (row, col)} of a
  Mosaic GPU `TiledLayout` over a [64·m, n] warpgroup array, from the
  layout's own tiling, warp, lane and vector dims (not from our reading
  of them): warp and lane numbers are split over their dims row-major, as
  Mosaic GPU's `_delinearize_index` splits them."""
  tiled = layout.tiling.tile_shape(shape)
  rank = len(tiled)
  dims = lambda ds: [d % rank for d in ds]
  warp_dims, lane_dims = dims(layout.warp_dims), dims(layout.lane_dims)
  vector_dim = layout.vector_dim % rank
  coordinates = {}
  for index in np.ndindex(*tiled):
    warp = np.ravel_multi_index([index[d] for d in warp_dims],
                                [tiled[d] for d in warp_dims])
    lane = np.ravel_multi_index([index[d] for d in lane_dims],
                                [tiled[d] for d in lane_dims])
    register = tuple(0 if d in (*warp_dims, *lane_dims, vector_dim) else i
                     for d, i in enumerate(index))
    coordinates[warp, lane, register, index[vector_dim]] = (
        layout.tiling.untile_indices(index))
  return coordinates
