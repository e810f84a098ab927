"""Short masked calls off the 8-row tiling, Mosaic against Triton: the data
behind `api.triton_first` for masked calls.

    python -m benchmarks.diagnostics.short_masked_route \
        --out benchmarks/results/h100_short_masked_route.json

`benchmarks.models` on cells of its kind that the suite does not carry: a
batch of prompts padded to 577 tokens (random lengths) at head dims 64,
128 and 256, and a causal 256-key window and six packed documents at
d=128; and d=64 padded lengths on the tiling (512 and 384 tokens,
`--cells padded_lengths_512_d64 padded_lengths_384_d64 --impls jax_flash
jax_flash_mosaic jax_flash_triton`, `results/h100_short_masked_route_d64.md`).
`jax_flash` shows the route `api.triton_first` picks; `jax_flash_mosaic`
and `jax_flash_triton` each kernel family (Mosaic reads rows off the
tiling in place, `rows.rows_in_place`).
"""
from __future__ import annotations

import sys

from benchmarks import models

C = models.ModelCell
CELLS = (
    # d=64 at lengths on the 8-row tiling, which Mosaic reads in place:
    # BERT large's batch with padded lengths, and a causal 384.
    C("padded_lengths_512_d64", "BERT large", 64, 512, 16, 16, 64,
      causal=False, padded=True),
    C("padded_lengths_384_d64", "d=64", 64, 384, 16, 16, 64, padded=True),
    C("padded_lengths_577_d64", "d=64", 64, 577, 16, 16, 64, padded=True),
    C("padded_lengths_577_d128", "Llama 3 8B", 32, 577, 32, 8, 128,
      padded=True),
    C("padded_lengths_577_d256", "Gemma 2 9B", 16, 577, 16, 8, 256,
      padded=True),
    C("window256_577_d128", "Llama 3 8B", 32, 577, 32, 8, 128, window=256),
    C("packed_docs_577_d128", "Llama 3 8B", 32, 577, 32, 8, 128,
      documents=6),
)


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  models.CELLS_BY_NAME.update({cell.name: cell for cell in CELLS})
  if "--cells" not in argv:
    argv += ["--cells", *(cell.name for cell in CELLS)]
  if "--impls" not in argv:
    argv += ["--impls", "jax_flash", "jax_flash_mosaic", "cudnn",
             "tokamax_mosaic"]
  return models.main(argv)


if __name__ == "__main__":
  sys.exit(main())
