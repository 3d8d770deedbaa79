"""GPU kernels for running ARMOR layers: pure tensors in and out, no knowledge of modules or files.

* :mod:`~torch_armor.kernels.block_diag`: the wrapper pass ``src · blockdiag(blocks)ᵀ (+ bias)`` as
  the custom op ``torch_armor::block_diag_rows`` (Triton on CUDA, a batched-matmul reference elsewhere).
* :mod:`~torch_armor.kernels.triton_block_diag`: its Triton kernel (needs ``triton``; under
  ``TRITON_INTERPRET=1`` it runs on CPU tensors, which is how the tests check it).
"""
