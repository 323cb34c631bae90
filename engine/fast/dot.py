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

from engine.kernels import interpreter_active


def _helper(fn):
    """A function the kernels call: jitted for the GPU compiler; under the Triton interpreter the plain function,
    run as Python by the interpreted kernel, whose launch has already patched triton.language. The interpreter
    patches the language again on every call of a jitted helper: about 5 ms of Python a call, 13.6 s of the 40 s
    one fast prefill test spent under cProfile (2,508 calls of `mm`). For the same reason the kernels write
    `tl.full(shape, 0.0, dtype)` where `tl.zeros(shape, dtype)` (a jitted library function doing just that) would
    do."""
    return fn if interpreter_active() else triton.jit(fn)


@_helper
def mm(a, b, INTERPRET: tl.constexpr):
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@_helper
def bf16_rne(x):
    """fp32 -> bf16 rounded to nearest even, by hand: the same bits on the GPU and under the Triton interpreter
    (whose own cast truncates). Finite inputs only."""
    bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
