"""Random compositions of the built-in variants and of variants closing
over arrays, drawn from a numpy Generator: for test_random_compositions.py
and the multi-device checks (distributed_checks.py)."""
import jax.numpy as jnp
import numpy as np

from pallas_attn import variants as V


def _segment_ids(rng, batch: int, length: int):
  """Sorted document ids, `[B, length]`, a few documents a row."""
  cuts = np.sort(rng.integers(0, length + 1, (batch, int(rng.integers(1, 5)))), axis=1)
  return jnp.asarray((np.arange(length)[None, :, None] >= cuts[:, None, :]).sum(-1), jnp.int32)


def components(rng, batch, heads, seq_q, seq_kv, elementwise: bool) -> dict:
  """Each candidate variant by name (built on demand from `rng`)."""
  offset = seq_kv - seq_q
  table = jnp.asarray(rng.standard_normal((heads, 2 * 64 + 1)), jnp.float32)
  head_bias = jnp.asarray(rng.standard_normal((batch, heads)), jnp.float32)
  padded = jnp.asarray(np.arange(seq_kv)[None, :] < rng.integers(1, seq_kv + 1, (batch, 1)))

  def relative_table(s, b, h, q_idx, kv_idx):
    return s + table[h, jnp.clip(q_idx + offset - kv_idx, -64, 64) + 64]

  def document():
    if seq_q == seq_kv:
      return V.document(_segment_ids(rng, batch, seq_kv), causal=bool(rng.random() < 0.5))
    kv_ids = _segment_ids(rng, batch, seq_kv)
    q_ids = (kv_ids[:, offset:] if offset >= 0 else
             jnp.pad(kv_ids, ((0, 0), (0, -offset)), mode="edge"))
    return V.document(q_segment_ids=q_ids, kv_segment_ids=kv_ids)

  return {
      "causal": lambda: V.causal(seq_q=seq_q, seq_kv=seq_kv),
      "window": lambda: V.sliding_window(int(rng.integers(1, 300)), bool(rng.random() < 0.7),
                                         seq_q=seq_q, seq_kv=seq_kv),
      "document": document,
      "prefix_lm": lambda: V.prefix_lm(jnp.asarray(rng.integers(0, seq_kv + 1, (batch,))),
                                       seq_q=seq_q, seq_kv=seq_kv),
      "alibi": lambda: V.alibi(num_heads=heads, seq_q=seq_q, seq_kv=seq_kv),
      "softcap": lambda: V.softcap(float(rng.uniform(2.0, 50.0))),
      "relative_table": lambda: V.Variant("relative_table", score_mod=relative_table),
      "head_bias": lambda: V.Variant(
          "head_bias", score_mod=lambda s, b, h, q_idx, kv_idx: s + head_bias[b, h]),
      "key_padding": lambda: V.Variant(
          "key_padding", mask_mod=lambda b, h, q_idx, kv_idx: padded[b, kv_idx]),
      **({} if not elementwise else {
          "sigmoid": lambda: V.sigmoid(seq_kv=seq_kv), "relu": lambda: V.relu(seq_kv=seq_kv)}),
  }


def random_variant(rng, batch, heads, seq_q, seq_kv, *, most: int):
  """(its name, `attention` keyword arguments) of up to `most` candidate
  variants composed (at most one rownorm other than softmax), with sinks
  on a quarter of the softmax ones."""
  elementwise = rng.random() < 0.15
  candidates = components(rng, batch, heads, seq_q, seq_kv, elementwise)
  names = sorted(rng.choice(sorted(candidates), size=int(rng.integers(0, most + 1)),
                            replace=False))
  second_rownorms = [n for n in names if n in ("sigmoid", "relu")][1:]
  names = [n for n in names if n not in second_rownorms]
  variant = V.compose(*(candidates[n]() for n in names)) if names else V.Variant("vanilla")
  kwargs = variant.kwargs()
  if variant.rownorm == "softmax" and rng.random() < 0.25:
    kwargs["sinks"] = jnp.asarray(rng.standard_normal(heads), jnp.float32)
    names.append("sinks")
  return "+".join(names) or "vanilla", kwargs
