"""`mm`: the tensor-core dot the kernels use, with a work-around for the Triton interpreter; `bf16_rne`: the
fp32 -> bf16 rounding the kernels store with.

On the GPU `mm(a, b)` is `tl.dot` on the bf16 operands (fp32 accumulator). Triton 3.9's CPU interpreter gets
`tl.dot` on bf16 operands wrong (it multiplies the raw 16-bit patterns), so under the interpreter the operands
(already rounded to bf16 by the caller) are widened to fp32 and multiplied in IEEE fp32: the same products,
summed in another order. `INTERPRET` is the constexpr the kernels receive from `backend.interpreter_active()`.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mm(a, b, INTERPRET: tl.constexpr):
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def bf16_rne(x):
    """fp32 -> bf16 rounded to nearest even, by hand: the same bits on the GPU and under the Triton interpreter
    (whose own cast truncates). Finite inputs only."""
    bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
