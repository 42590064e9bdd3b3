"""How fast is split-KV decoding against cuDNN, FlexAttention, SDPA and our
parallel template?

    python benchmarks/decoding.py [--cases b8_32k b1_128k] [--impls decode cudnn]

Cases (bf16, Hq 32, Hkv 8, d 128, every sequence holding the whole cache):
Sq 1 at B8 8k, B8 32k, B1 128k, B64 4k; Sq 4 at B8 32k and B1 128k; a
4096-key sliding window (causal) over B8 32k and B1 128k caches.
Implementations: decode = `decode_attention` (kv_lengths = S); paged =
`paged_attention` on the same keys in 16-key pages (vLLM's default),
shuffled; decode_fp8 / paged_fp8 = the same on an e4m3 cache with per-head
descales (`quantize_fp8`; their GB/s count the bf16 cache's bytes, so they
read fp8 at half the figure; their rows' `extra.rel_err_f32` hold the
errors against float32 attention, `fp8_accuracy`); attention = `attention`
(Sq <= 16 dispatches to the split-KV template); parallel = `attention` with
the parallel template's heuristic config (the path before split-KV); cudnn
= `dot_product_attention` with query and key lengths (without, if cuDNN
refuses them), for the window on the
window's keys sliced beforehand (the same work, no mask); flex and sdpa
(PyTorch, GQA; the window as a block mask built once). By throughput, and
by kernel time in alternating rounds (ratios: theirs / decode's per round).
GB/s count the K/V bytes the attended keys occupy (the window's for the
window rows); the device's HBM peak is in the results' notes. Writes
`decoding.json` to `--out`.
"""
from __future__ import annotations

import harness

import jax  # noqa: E402 (after harness: it sets JAX's memory for PyTorch)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_attn as pa  # noqa: E402
from pallas_attn import bench  # noqa: E402
from pallas_attn.schedule.config import heuristic_config  # noqa: E402

HEADS, KV_HEADS, D, PAGE = 32, 8, 128, 16
CASES = {  # name: (batch, seq, seq_q, window)
    "b8_8k": (8, 8192, 1, None), "b8_32k": (8, 32768, 1, None),
    "b1_128k": (1, 131072, 1, None), "b64_4k": (64, 4096, 1, None),
    "b8_32k_sq4": (8, 32768, 4, None), "b1_128k_sq4": (1, 131072, 4, None),
    "b8_32k_window4k": (8, 32768, 1, 4096), "b1_128k_window4k": (1, 131072, 1, 4096),
}
SMALL = {"b2_512": (2, 512, 1, None), "b1_1k_sq4": (1, 1024, 4, None),
         "b1_1k_window256": (1, 1024, 1, 256)}
IMPLS = ("decode", "paged", "decode_fp8", "paged_fp8", "attention", "parallel", "cudnn", "flex",
         "sdpa")
HBM_TB_S = {"h100": 3.35, "h200": 4.8, "b200": 8.0}  # peak, SXM parts


def paged(x, seed=0):
  """(pages `[B*S/P, P, Hkv, D]` in shuffled order, page table `[B, S/P]`)."""
  b, s = x.shape[:2]
  pages = x.reshape(b * s // PAGE, PAGE, *x.shape[2:])
  order = np.random.default_rng(seed).permutation(pages.shape[0])
  stored = jnp.zeros_like(pages).at[order].set(pages)
  return stored, jnp.asarray(order.reshape(b, s // PAGE), jnp.int32)


def compiled(fn, *args):
  jitted = jax.jit(fn)
  jax.block_until_ready(jitted(*args))
  return lambda: jitted(*args)


def cudnn_call(q, k, v, lengths, keys_read):
  """cuDNN on the last `keys_read` keys, with query and key lengths where it takes them."""
  first = k.shape[1] - keys_read
  k, v = k[:, first:], v[:, first:]
  queries = jnp.full_like(lengths, q.shape[1])
  try:
    return compiled(lambda q, k, v, n: jax.nn.dot_product_attention(
        q, k, v, query_seq_lengths=queries, key_value_seq_lengths=n, implementation="cudnn"),
        q, k, v, jnp.full_like(lengths, keys_read))
  except Exception:  # refused lengths: the whole (sliced) cache, the same work here
    return compiled(lambda q, k, v: jax.nn.dot_product_attention(q, k, v,
                                                                 implementation="cudnn"), q, k, v)


def builders(name, spec, impls):
  """({(case, impl, "decode"): build}, K/V gigabytes read) of one case."""
  batch, seq, seq_q, window = spec
  c = bench.case(name, "vanilla" if window is None else f"window{window}", batch, seq,
                 seq_q=seq_q, heads=HEADS, kv_heads=KV_HEADS, d_qk=D)
  inputs = bench.make_inputs(c)
  q, k, v = inputs.q, inputs.k, inputs.v
  lengths = jnp.full((batch,), seq, jnp.int32)
  unaligned = {} if window is None else pa.variants.sliding_window(window).kwargs()
  aligned = c.build().kwargs(None)
  keys_read = min(seq, (window or seq) + seq_q - 1)

  def paged_call(k, v, **scales):
    (k_pages, table), (v_pages, _) = paged(k), paged(v)
    return compiled(lambda q, kp, vp, t, n: pa.paged_attention(q, kp, vp, t, n, **unaligned,
                                                               **scales),
                    q, k_pages, v_pages, table, lengths)

  def fp8_cache():
    """(k, v) in e4m3 and their per-head descales (the fp8 rows' inputs)."""
    (k8, k_descale), (v8, v_descale) = (pa.quantize_fp8(x) for x in (k, v))
    return k8, v8, dict(k_descale=k_descale, v_descale=v_descale)

  def decode_fp8():
    k8, v8, scales = fp8_cache()
    return compiled(lambda q, k, v, n: pa.decode_attention(q, k, v, n, **unaligned, **scales),
                    q, k8, v8, lengths)

  def paged_fp8():
    k8, v8, scales = fp8_cache()
    return paged_call(k8, v8, **scales)
  config = heuristic_config(seq_q, seq, D, D, block_sparse=window is not None)
  calls = {
      "decode": lambda: compiled(lambda q, k, v, n: pa.decode_attention(q, k, v, n, **unaligned),
                                 q, k, v, lengths),
      "paged": lambda: paged_call(k, v),
      "decode_fp8": decode_fp8,
      "paged_fp8": paged_fp8,
      "attention": lambda: compiled(lambda q, k, v: pa.attention(q, k, v, **aligned), q, k, v),
      "parallel": lambda: compiled(lambda q, k, v: pa.attention(q, k, v, config=config,
                                                                **aligned), q, k, v),
      "cudnn": lambda: cudnn_call(q, k, v, lengths, keys_read),
      "flex": lambda: harness.torch_call("flex", c, "fwd", inputs),
      "sdpa": lambda: harness.torch_call("sdpa", c, "fwd", inputs),
  }
  gbytes = batch * KV_HEADS * keys_read * 2 * D * 2 / 1e9
  return {(name, impl, "decode"): calls[impl] for impl in impls}, gbytes


def fp8_accuracy(name, spec) -> dict:
  """Relative errors (`harness.rel_err`) of decode_attention against float32
  attention over every key, Sq 1 and no window: a bf16 cache against the
  bf16 inputs; an e4m3 cache (per-head descales) against its dequantized
  values and against the bf16 inputs it was quantized from; on normal keys
  and values, and with an outlier channel (x20 in channel 3) in both.
  Inputs are float32 normals rounded to bf16: normals drawn in bf16 take few
  distinct values, whose rounding errors in e4m3 then add up instead of
  averaging out (18% at 32k keys against 4% here)."""
  batch, seq, _, _ = spec
  keys = jax.random.split(jax.random.key(1), 3)
  q, k, v = (jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16) for key, shape in
             zip(keys, ((batch, 1, HEADS, D), *2 * ((batch, seq, KV_HEADS, D),))))
  lengths = jnp.full((batch,), seq, jnp.int32)
  reference = jax.jit(lambda k, v: jax.nn.dot_product_attention(
      q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32)))
  decode = jax.jit(pa.decode_attention)
  found = {}
  outliers = lambda x: x.at[..., 3].multiply(20)
  for label, k, v in (("", k, v), ("_outliers", outliers(k), outliers(v))):
    (k8, k_descale), (v8, v_descale) = (pa.quantize_fp8(x) for x in (k, v))
    dequantized = [x.astype(jnp.float32) * s[:, None, :, None]
                   for x, s in ((k8, k_descale), (v8, v_descale))]
    fp8 = [np.asarray(decode(q, k8, v8, lengths, k_descale=k_descale, v_descale=v_descale),
                      np.float32)]
    err = lambda out, ref: harness.rel_err(out, [np.asarray(ref, np.float32)])
    found[f"bf16{label}"] = err([np.asarray(decode(q, k, v, lengths), np.float32)],
                                reference(k, v))
    found[f"fp8_vs_dequantized{label}"] = err(fp8, reference(*dequantized))
    found[f"fp8_vs_bf16_inputs{label}"] = err(fp8, reference(k, v))
  return found


def main(argv=None):
  parser = harness.parser(__doc__.splitlines()[0])
  parser.add_argument("--cases", nargs="+", default=None, help="case names (default: all)")
  parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
  args = parser.parse_args(argv)
  cases = SMALL if args.small else CASES
  budget = harness.Budget(args.budget_s)
  rows, ratios = [], []
  for name, spec in cases.items():
    if args.cases and name not in args.cases:
      continue
    found, gbytes = builders(name, spec, args.impls)
    r, q = harness.measure_calls(found, rounds=args.rounds, budget=budget,
                                 gbytes={(name, "decode"): gbytes})
    if spec[2] == 1 and spec[3] is None and {"decode_fp8", "paged_fp8"} & set(args.impls):
      accuracy = fp8_accuracy(name, spec)
      for row in r:
        if row.impl in ("decode", "decode_fp8", "paged_fp8"):
          row.extra["rel_err_f32"] = accuracy
    rows += r
    ratios += q
    harness.checkpoint(args, "decoding", rows, ratios)
  kind = jax.devices()[0].device_kind.lower()
  peak = next((tb for part, tb in HBM_TB_S.items() if part in kind), None)
  harness.finish(args, "decoding", rows, ratios, notes=f"HBM peak {peak} TB/s" if peak else "")


if __name__ == "__main__":
  main()
