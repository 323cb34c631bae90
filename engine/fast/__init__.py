"""The fast GPU path of the K3.1 engine: Triton kernels that read the packed row pool in-kernel, and a batched
bf16 decode forward built on them. The reference ops (engine/model/) stay the oracle; every kernel here has its
`naive_*` reference beside it (most of them call the reference ops) and a test in tests/engine/fast/.

- `backend.py`: the `kernels` choice (`reference` | `fast`) and when `fast` may run (CUDA, or the Triton
  interpreter for CPU tests).
- `pages.py`: a decode batch's page table (sub-block ids of every request) and row ids, built once per step.
- `indexer.py`: DSA index scores of one query per request against its FP8 index keys read from the pages,
  then the top-k selection.
- `mla.py`: sparse MLA decode in absorbed form over the selected FP8 latents read from the pages (split-K).
- `kda.py`: the KDA recurrent step in place on the packed KDA rows, and the short-conv step.
- `decoder.py`: `FastDecoder`, one batched bf16 decode forward over every running request.
- `prefill_attention.py`: a prefill's page writes, causal indexer scores over query x key blocks from the FP8
  pages + top-k per query chunk, and sparse MLA over the selections (the decode kernel, one query per "request").
- `prefill_kda.py`: KDA conv and chunked recurrence (fla-core's chunk_kda on CUDA) from and into a KDA row.
- `moe.py`: routed experts of many tokens as grouped batched GEMMs over tokens sorted by expert.
- `prefill.py`: `FastPrefiller`, one request's prefill (any start) into its packed rows, on FastDecoder's segments.
"""
