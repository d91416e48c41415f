"""Triton kernels of the fused loss: the row kernel (``rows``), the logits GEMM that leaves
log-sum-exp partials (``logits``) and the in-place gradient scaling (``scale``), with the math
they share (``common``). Imported only when the Triton backend is used; under
``TRITON_INTERPRET=1`` every kernel runs on CPU tensors."""
