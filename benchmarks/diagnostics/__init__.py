"""Diagnostics: scripts that explain a measurement rather than make one.

Each is a module, run from the repository root as
`python -m benchmarks.diagnostics.NAME` (its docstring has the arguments):

  backward_breakdown  one grid cell's fwd+bwd piece by piece, beside tokamax
  block_mask_probe    what building a mask_fn's BlockMask costs each call
  compile_probe       compile, first-run and second-run time per shape
  float32_probe       float32 on the Triton path: tiles, dot precision, error
  kernel_profile      a program's GPU kernels by time (the generation loop)
  ncu_kernels         one cell's kernels, once each, for Nsight Compute
  ncu_summary         tables from Nsight Compute's raw and SASS exports
  order_probe         does the kernel timed before move a timing (clocks)
  timing_probe        does a sample's length move a timing (host latency)
  ring_overhead       the ring on a one-device mesh against flash_attention
  roofline            FLOPs, bytes and the bound times of every grid cell
  sass_spills         local-memory accesses in a SASS dump, per warpgroup or loop
"""
