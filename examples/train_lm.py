"""Train a small character-level decoder-only transformer with pallas_attn's
layers, beside the same model on JAX's attention.

    python examples/train_lm.py --variant vanilla             # GPU: S=4096, bf16
    python examples/train_lm.py --variant softcap --steps 300
    python examples/train_lm.py --framework equinox           # vanilla, Equinox
    python examples/train_lm.py --tiny                        # CPU, interpret mode, < 2 min
    python examples/train_lm.py --check-steps 40              # attention gradients vs cuDNN

Every model starts from the same weights (ours is built first; the peers
load its state, which is Flax's layout) and sees the same batches. Peers:
`cudnn` and `xla` are `jax.nn.dot_product_attention` with that
implementation where it expresses the variant (causal masks, an additive
bias, a local window); `xla` is otherwise the dense attention written in
jnp (scores materialized); `equinox` is `equinox.nn.MultiheadAttention`.
On a GPU each model's training step is timed after the run (warmed up,
back-to-back steps, `block_until_ready` at the end of each window) and
reported as tokens/s. The loss curves go to `--out` (default
benchmarks/results/) as JSON, and as a PNG when matplotlib is installed.

Runs are reproducible: seeds are fixed (`--seed`) and XLA's deterministic
GPU ops are on (`--no-deterministic` for its faster ones), so the same
arguments give the same losses bit for bit (the cuDNN peer needs
`--no-deterministic`, examples/README.md says why). `--check-steps N` follows our
model for N steps and compares, at each, the attention projections'
gradients with each peer's at the same parameters: a divergence of the
curves that these stay flat through comes from the trajectories, not from
one step's attention.

Variants (all causal): vanilla; alibi_window (ALiBi + a sliding window,
no position embedding); softcap (Gemma-2-style logit cap 30); sigmoid
(sigmoid attention, bias -log S).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from pallas_attn import variants as V  # noqa: E402
from pallas_attn.layers import flax as pa_flax  # noqa: E402
from pallas_attn.schedule.timing import median_time_ms  # noqa: E402

# The corpus: "The Keeper's Almanac", an original text written for this
# repository (43 KB) and dedicated to the public domain (CC0 1.0) by its
# authors; examples/data/README.md says so.
CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "corpus.txt")
VARIANTS = ("vanilla", "alibi_window", "softcap", "sigmoid")


@dataclasses.dataclass(frozen=True)
class Config:
  seq_len: int = 4096
  batch: int = 4
  d_model: int = 1024
  heads: int = 8
  layers: int = 4
  window: int = 1024
  steps: int = 100
  lr: float = 1e-3
  dtype: str = "bfloat16"
  seed: int = 0


TINY = dict(seq_len=32, batch=4, d_model=32, heads=2, layers=1, window=8, steps=12, lr=3e-3,
            dtype="float32")


def variant_of(name: str, cfg: Config) -> V.Variant:
  """The example's variants, all causal."""
  if name == "vanilla":
    return V.causal()
  if name == "alibi_window":
    return V.alibi(num_heads=cfg.heads) + V.sliding_window(cfg.window)
  if name == "softcap":
    return V.softcap(30.0) + V.causal()
  if name == "sigmoid":
    return V.sigmoid(seq_kv=cfg.seq_len) + V.causal()
  raise ValueError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")


# ----------------------------------------------------------------------------- peers

def jax_nn_attention(name: str, cfg: Config, implementation: str):
  """`jax.nn.dot_product_attention` running the variant, or None where it
  cannot express it (score transforms other than a bias, other rownorms)."""
  if name == "vanilla":
    extra = {}
  elif name == "alibi_window":
    s = cfg.seq_len
    bias = V.alibi(num_heads=cfg.heads).score_mod(
        jnp.zeros((1, cfg.heads, s, s)), *index_grids(1, cfg.heads, s, s))
    extra = dict(bias=bias, local_window_size=(cfg.window - 1, 0))
  else:
    return None

  def attention_fn(q, k, v, **_):
    bias = extra.get("bias")
    return jax.nn.dot_product_attention(
        q, k, v, bias=None if bias is None else bias.astype(q.dtype), is_causal=True,
        local_window_size=extra.get("local_window_size"), implementation=implementation)
  return attention_fn


def embed_tokens(tokens, table, dtype):
  """`table[tokens]` as a one-hot matmul. Its gradient is then a matmul too:
  the gather's is a scatter-add into the ~80 rows of a character vocabulary,
  whose colliding updates took 8.4 ms of a 28.5 ms step on an H100 (the
  same in both models, profile_train_step in benchmarks/results/NOTES.md); as a
  matmul, 0.1 ms."""
  return jax.nn.one_hot(tokens, table.shape[0], dtype=dtype) @ table.astype(dtype)


def index_grids(batch, heads, seq_q, seq_kv):
  """b, h, q_idx, kv_idx as broadcastable int32 arrays."""
  return (jnp.arange(batch)[:, None, None, None], jnp.arange(heads)[None, :, None, None],
          jnp.arange(seq_q)[None, None, :, None], jnp.arange(seq_kv)[None, None, None, :])


def dense_attention(variant: V.Variant):
  """The variant as plain XLA: `[B, H, S, S]` float32 scores from
  input-dtype matmuls, the variant's callables on index grids."""
  def attention_fn(q, k, v, **_):
    batch, seq_q, heads, d = q.shape
    group = heads // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(d)
    grids = index_grids(batch, heads, seq_q, k.shape[1])
    if variant.score_mod is not None:
      s = variant.score_mod(s, *grids)
    keep = variant.mask_mod(*grids)
    if variant.rownorm == "softmax":
      w = jax.nn.softmax(jnp.where(keep, s, -jnp.inf), axis=-1)
    elif variant.rownorm == "sigmoid":
      w = jnp.where(keep, jax.nn.sigmoid(s), 0.0)
    else:
      raise ValueError(f"dense_attention has no rownorm {variant.rownorm!r}")
    return jnp.einsum("bhqk,bkhd->bqhd", w.astype(v.dtype), v,
                      preferred_element_type=jnp.float32).astype(q.dtype)
  return attention_fn


def peer_attention_fns(name: str, cfg: Config, peers: list[str]) -> dict:
  """{peer: attention_fn or a reason it cannot run this variant}."""
  fns = {}
  for peer in peers:
    fn = jax_nn_attention(name, cfg, peer)
    if fn is None:
      fn = (dense_attention(variant_of(name, cfg)) if peer == "xla" else
            f"jax.nn.dot_product_attention(implementation={peer!r}) cannot express {name}")
    fns[peer] = fn
  return fns


# ----------------------------------------------------------------------------- models

class FlaxBlock(nnx.Module):
  """Pre-LayerNorm transformer block: attention, then a 4x GELU MLP."""

  def __init__(self, cfg: Config, attention: nnx.Module, rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.dtype)
    self.norm1 = nnx.LayerNorm(cfg.d_model, dtype=dtype, rngs=rngs)
    self.attention = attention
    self.norm2 = nnx.LayerNorm(cfg.d_model, dtype=dtype, rngs=rngs)
    self.up = nnx.Linear(cfg.d_model, 4 * cfg.d_model, dtype=dtype, rngs=rngs)
    self.down = nnx.Linear(4 * cfg.d_model, cfg.d_model, dtype=dtype, rngs=rngs)

  def __call__(self, x):
    x = x + self.attention(self.norm1(x))
    return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class FlaxLM(nnx.Module):
  """Character-level decoder-only transformer; `make_attention(rngs)` builds
  each block's attention layer. Learned positions unless the variant
  carries its own (ALiBi)."""

  def __init__(self, cfg: Config, vocab: int, make_attention, positions: bool,
               rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.dtype)
    self.embed = nnx.Embed(vocab, cfg.d_model, dtype=dtype, rngs=rngs)
    self.positions = (nnx.Embed(cfg.seq_len, cfg.d_model, dtype=dtype, rngs=rngs)
                      if positions else None)
    self.blocks = nnx.List([FlaxBlock(cfg, make_attention(rngs), rngs)
                            for _ in range(cfg.layers)])
    self.norm = nnx.LayerNorm(cfg.d_model, dtype=dtype, rngs=rngs)
    self.head = nnx.Linear(cfg.d_model, vocab, dtype=dtype, rngs=rngs)

  def __call__(self, tokens):
    x = embed_tokens(tokens, self.embed.embedding[...], self.embed.dtype)
    if self.positions is not None:  # a slice: its gradient is a pad, not a scatter-add
      x = x + self.positions.embedding[:tokens.shape[1]].astype(self.positions.dtype)
    for block in self.blocks:
      x = block(x)
    return self.head(self.norm(x)).astype(jnp.float32)


def flax_models(name: str, cfg: Config, vocab: int, peers: dict) -> dict:
  """{label: (params, loss_fn)}: ours first, then each peer loading its weights."""
  dtype = jnp.dtype(cfg.dtype)
  mha = dict(num_heads=cfg.heads, in_features=cfg.d_model, decode=False, dtype=dtype)
  positions = name != "alibi_window"
  ours = FlaxLM(cfg, vocab, lambda rngs: pa_flax.MultiHeadAttention(
      **mha, variant=variant_of(name, cfg), rngs=rngs), positions, nnx.Rngs(cfg.seed))
  models = {"pallas_attn": ours}
  for peer, fn in peers.items():
    if callable(fn):
      model = FlaxLM(cfg, vocab, lambda rngs: nnx.MultiHeadAttention(
          **mha, attention_fn=fn, rngs=rngs), positions, nnx.Rngs(cfg.seed + 1))
      nnx.update(model, nnx.state(ours, nnx.Param))  # Flax's layout: ours loads into theirs
      models[peer] = model

  def functional(model):
    graphdef, params = nnx.split(model, nnx.Param)
    return params, lambda p, tokens: nnx.merge(graphdef, p)(tokens)
  return {label: functional(model) for label, model in models.items()}


def equinox_models(name: str, cfg: Config, vocab: int) -> dict:
  """{label: (params, loss_fn)}: our Equinox layer and Equinox's own, vanilla."""
  import equinox as eqx
  from pallas_attn.layers import equinox as pa_eqx
  if name != "vanilla":
    raise SystemExit("--framework equinox runs the vanilla variant (Equinox's own layer, the "
                     "peer, expresses a causal mask only)")
  dtype = jnp.dtype(cfg.dtype)
  causal = jnp.tril(jnp.ones((cfg.seq_len, cfg.seq_len), bool))

  class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    dense_mask: bool = eqx.field(static=True)

    def __call__(self, x):
      h = jax.vmap(self.norm1)(x)
      x = x + self.attention(h, h, h, mask=causal[:x.shape[0], :x.shape[0]]
                             if self.dense_mask else None)
      return x + jax.vmap(lambda t: self.down(jax.nn.gelu(self.up(self.norm2(t)))))(x)

  class LM(eqx.Module):
    embed: eqx.nn.Embedding
    positions: eqx.nn.Embedding
    blocks: list
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __call__(self, tokens):  # one sequence; vmapped over the batch
      x = (embed_tokens(tokens, self.embed.weight, self.embed.weight.dtype)
           + self.positions.weight[:tokens.shape[0]])
      for block in self.blocks:
        x = block(x)
      return jax.vmap(lambda t: self.head(self.norm(t)))(x).astype(jnp.float32)

  def build(attention_cls, dense_mask, **extra):
    keys = iter(jax.random.split(jax.random.PRNGKey(cfg.seed), 4 + 3 * cfg.layers))
    d = cfg.d_model
    blocks = [Block(eqx.nn.LayerNorm(d), attention_cls(cfg.heads, d, key=next(keys), **extra),
                    eqx.nn.LayerNorm(d), eqx.nn.Linear(d, 4 * d, key=next(keys)),
                    eqx.nn.Linear(4 * d, d, key=next(keys)), dense_mask)
              for _ in range(cfg.layers)]
    return LM(eqx.nn.Embedding(vocab, d, key=next(keys)),
              eqx.nn.Embedding(cfg.seq_len, d, key=next(keys)), blocks, eqx.nn.LayerNorm(d),
              eqx.nn.Linear(d, vocab, key=next(keys)))

  def functional(model):
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def apply(p, tokens):  # compute in cfg.dtype, keep float32 master weights
      cast = jax.tree.map(lambda x: x.astype(dtype), p)
      return jax.vmap(eqx.combine(cast, static))(tokens)
    return params, apply
  return {"pallas_attn": functional(build(pa_eqx.MultiheadAttention, False,
                                          variant=variant_of(name, cfg))),
          "equinox": functional(build(eqx.nn.MultiheadAttention, True))}


# ----------------------------------------------------------------------------- training

def load_corpus(path: str = CORPUS):
  """(train ids, validation ids, vocab size): characters of the corpus, the
  last 10% held out."""
  with open(path, encoding="utf-8") as f:
    text = f.read()
  chars = sorted(set(text))
  ids = np.asarray([chars.index(c) for c in text], np.int32)
  split = int(0.9 * len(ids))
  return ids[:split], ids[split:], len(chars)


def batches(ids, cfg: Config, count: int, seed: int):
  """`count` batches of `cfg.batch` random windows of seq_len + 1 tokens."""
  if len(ids) <= cfg.seq_len + 1:
    raise SystemExit(f"the corpus split has {len(ids)} characters, fewer than seq_len + 1 = "
                     f"{cfg.seq_len + 1}: lower --seq-len")
  rng = np.random.RandomState(seed)
  for _ in range(count):
    starts = rng.randint(0, len(ids) - cfg.seq_len - 1, cfg.batch)
    yield jnp.asarray(np.stack([ids[s:s + cfg.seq_len + 1] for s in starts]))


# Timed windows of about a second of steps: the host takes 5-10 ms to
# dispatch one step of these programs, which a window's first step waits
# for on an idle device; at the default 20 ms window (one step) that latency
# was a quarter of our step time (H200: 20.4 ms per step timed, 15.5 ms of
# back-to-back device time).
STEP_WINDOW_MS = 1000.0


def loss_of(apply):
  """Next-character cross-entropy of a model's `apply(params, tokens)`."""
  def loss_fn(params, batch):
    logits = apply(params, batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
  return loss_fn


def make_optimizer(cfg: Config):
  schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, max(1, cfg.steps // 10), cfg.steps)
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.95))


def make_step(apply, optimizer):
  loss_fn = loss_of(apply)

  @jax.jit
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return step, jax.jit(loss_fn)


def progress(label: str, step: int, total: int, loss: float, started: float):
  """A one-line progress bar on stdout (rewritten in place on a terminal)."""
  width = 30
  done = int(width * step / total)
  line = (f"{label:>12} [{'#' * done}{'.' * (width - done)}] {step}/{total} "
          f"loss {loss:.3f} {time.perf_counter() - started:.0f}s")
  if sys.stdout.isatty():
    print("\r" + line, end="\n" if step == total else "", flush=True)
  elif step == total or step % max(1, total // 5) == 0:
    print(line, flush=True)


def train(label, params, apply, cfg: Config, train_ids, val_ids, timed: bool):
  optimizer = make_optimizer(cfg)
  step, loss_fn = make_step(apply, optimizer)
  opt_state = optimizer.init(params)
  losses, started = [], time.perf_counter()
  for i, batch in enumerate(batches(train_ids, cfg, cfg.steps, cfg.seed), 1):
    params, opt_state, loss = step(params, opt_state, batch)
    losses.append(loss)
    if i == cfg.steps or i % max(1, cfg.steps // 20) == 0:
      progress(label, i, cfg.steps, float(loss), started)
  result = dict(losses=[float(x) for x in losses],
                val_loss=float(np.mean([loss_fn(params, b) for b in
                                        batches(val_ids, cfg, 4, cfg.seed + 1)])))
  if timed:  # the same step on a fixed batch, back to back after warmup
    batch = next(batches(train_ids, cfg, 1, cfg.seed))
    ms = median_time_ms(lambda: step(params, opt_state, batch), warmup=3, reps=5,
                        window_ms=STEP_WINDOW_MS)
    result.update(step_ms=ms, tokens_per_s=cfg.batch * cfg.seq_len / (ms / 1e3))
  return result


ATTENTION_PROJECTIONS = ("query", "key", "value", "out")


def check_steps(models: dict, cfg: Config, train_ids, steps: int) -> list:
  """Our attention's gradients against each peer's at the same parameters.

  Follows our model's training for `steps` steps; at each, every model's
  gradient is taken at our parameters on the step's batch (the Flax peers
  share our parameter layout), and each attention projection's gradient
  matrix is compared: relative error against the peer's and cosine. A divergence
  of the loss curves that these stay flat through comes from the runs'
  trajectories (rounding amplified by training), not from a step's
  attention gradient. Returns one record per step and peer.
  """
  params, apply = models["pallas_attn"]
  grads_of = {label: jax.jit(jax.value_and_grad(loss_of(peer_apply)))
              for label, (_, peer_apply) in models.items()}
  optimizer = make_optimizer(cfg)
  step, _ = make_step(apply, optimizer)
  opt_state = optimizer.init(params)
  records = []
  for i, batch in enumerate(batches(train_ids, cfg, steps, cfg.seed), 1):
    gradients = {label: grads_of[label](params, batch) for label in grads_of}
    loss, ours = gradients.pop("pallas_attn")
    for label, (peer_loss, theirs) in gradients.items():
      layers = []
      for (path, g), h in zip(jax.tree_util.tree_flatten_with_path(ours)[0],
                              jax.tree_util.tree_leaves(theirs)):
        name = jax.tree_util.keystr(path, simple=True, separator=".").removesuffix(".value")
        if ("attention" not in name or not name.endswith("kernel")
            or not any(p in name for p in ATTENTION_PROJECTIONS)):
          continue  # biases: the key bias's gradient is zero (softmax ignores it), all noise
        g, h = (np.asarray(x, np.float64).ravel() for x in (g, h))
        layers.append(dict(param=name,
                           rel_err=float(np.linalg.norm(g - h) / max(np.linalg.norm(h), 1e-30)),
                           cosine=float(g @ h / max(np.linalg.norm(g) * np.linalg.norm(h),
                                                    1e-30))))
      worst = max(layers, key=lambda layer: layer["rel_err"])
      records.append(dict(step=i, peer=label, loss=float(loss), peer_loss=float(peer_loss),
                          layers=layers))
      print(f"check step {i:>3} vs {label}: loss {float(loss):.4f} (peer "
            f"{float(peer_loss):.4f}); worst attention gradient {worst['param']}: relative "
            f"error {worst['rel_err']:.2e}, cosine "
            f"{min(layer['cosine'] for layer in layers):.6f}", flush=True)
    params, opt_state, _ = step(params, opt_state, batch)
  return records


def device_slug() -> str:
  device = jax.devices()[0]
  found = re.search(r"[a-z]\d{2,4}", device.device_kind.lower())
  return found.group(0) if found and device.platform == "gpu" else device.platform


def plot(results: dict, title: str, path: str) -> bool:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib is not installed: no plot (the JSON has the curves)")
    return False
  fig, (curves, differences) = plt.subplots(1, 2, figsize=(12, 4))
  ours = np.asarray(results["pallas_attn"]["losses"])
  steps = np.arange(1, len(ours) + 1)
  for (label, result), style in zip(results.items(), ("-", "--", ":", "-.")):
    speed = f", {result['tokens_per_s'] / 1e3:.0f}k tok/s" if "tokens_per_s" in result else ""
    curves.plot(steps, result["losses"], style, label=label + speed)
    if label != "pallas_attn":
      differences.plot(steps, np.asarray(result["losses"]) - ours, style, label=label)
  curves.set(xlabel="step", ylabel="training loss (nats/char)", title=title)
  differences.set(xlabel="step", ylabel="peer loss - pallas_attn loss",
                  title="difference (same weights, same batches)")
  curves.legend()
  if len(results) > 1:
    differences.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--variant", choices=VARIANTS, default="vanilla")
  parser.add_argument("--framework", choices=("flax", "equinox"), default="flax")
  parser.add_argument("--tiny", action="store_true",
                      help="a CPU-sized model (interpret mode); overrides the sizes")
  for field in dataclasses.fields(Config):
    parser.add_argument("--" + field.name.replace("_", "-"), type=type(field.default),
                        default=None)
  parser.add_argument("--peers", default="auto",
                      help="comma-separated from cudnn, xla (Flax); auto: cudnn and xla on a "
                           "GPU, xla elsewhere; none")
  parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
  parser.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                      help="XLA's deterministic GPU ops (default): with the fixed --seed, the "
                           "same arguments give the same losses bit for bit (our kernels are "
                           "deterministic anyway); --no-deterministic for XLA's faster ones, "
                           "and for the cudnn peer, which fails under them")
  parser.add_argument("--check-steps", type=int, default=0, metavar="N",
                      help="instead of training each model: follow ours for N steps and "
                           "compare, at each, the attention projections' gradients with each "
                           "peer's at the same parameters (Flax)")
  args = parser.parse_args(argv)
  if args.deterministic:
    deterministic_xla()

  sizes = dict(TINY) if args.tiny else {}
  sizes.update({f.name: getattr(args, f.name) for f in dataclasses.fields(Config)
                if getattr(args, f.name) is not None})
  cfg = Config(**sizes)
  on_gpu = jax.default_backend() == "gpu"
  train_ids, val_ids, vocab = load_corpus()
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {args.framework}, variant "
        f"{args.variant}; corpus {len(train_ids) + len(val_ids)} chars, vocab {vocab}; {cfg}")

  if args.framework == "equinox":
    models = equinox_models(args.variant, cfg, vocab)
    skipped = {}
  else:
    peers = (["cudnn", "xla"] if on_gpu else ["xla"]) if args.peers == "auto" else (
        [] if args.peers == "none" else args.peers.split(","))
    fns = peer_attention_fns(args.variant, cfg, peers)
    if args.deterministic and callable(fns.get("cudnn")):
      fns["cudnn"] = ("cuDNN's attention fails under XLA's deterministic ops (jax 0.11.2: "
                      "IndexError inside XLA); --no-deterministic runs it, its curve then "
                      "varying run to run (examples/README.md)")
    skipped = {peer: fn for peer, fn in fns.items() if isinstance(fn, str)}
    models = flax_models(args.variant, cfg, vocab, fns)
  for peer, reason in skipped.items():
    print(f"{peer}: skipped, {reason}")
  if args.check_steps:
    if args.framework != "flax" or len(models) < 2:
      raise SystemExit("--check-steps compares Flax models with a peer: --framework flax and "
                       "--peers with one that runs the variant")
    checks = check_steps(models, cfg, train_ids, args.check_steps)
    return write_record(args, cfg, vocab, dict(check_steps=checks, skipped=skipped))

  results = {}
  for label, (params, apply) in models.items():
    try:
      results[label] = train(label, params, apply, cfg, train_ids, val_ids, timed=on_gpu)
    except Exception as error:  # a peer that fails (cuDNN refusing a shape) is reported
      if label == "pallas_attn":
        raise
      skipped[label] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
      print(f"{label}: failed, {skipped[label]}")
  for label, result in results.items():
    speed = (f", {result['tokens_per_s']:,.0f} tokens/s ({result['step_ms']:.1f} ms/step)"
             if "tokens_per_s" in result else "")
    print(f"{label:>12}: final loss {result['losses'][-1]:.3f}, validation "
          f"{result['val_loss']:.3f}{speed}")
  ours = results["pallas_attn"]
  ratios = {f"pallas_attn_vs_{label}": ours["tokens_per_s"] / r["tokens_per_s"]
            for label, r in results.items() if label != "pallas_attn" and "tokens_per_s" in r}
  for name, ratio in ratios.items():
    print(f"{name}: {ratio:.3f}x tokens/s")

  record = write_record(args, cfg, vocab, dict(results=results, ratios=ratios,
                                                skipped=skipped))
  stem = record["path"].removesuffix(".json")
  if plot(results, f"{args.framework} {args.variant}, S={cfg.seq_len}, "
                   f"{device_slug()}", stem + ".png"):
    print(f"wrote {stem}.png")
  return record


def deterministic_xla():
  """Asks XLA for deterministic GPU ops (no atomics whose order varies, in
  scatter-adds and reductions). Takes effect where no JAX backend has
  started yet: run before the first device use."""
  flag = "--xla_gpu_deterministic_ops=true"
  flags = os.environ.get("XLA_FLAGS", "")
  if flag not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()


def write_record(args, cfg: Config, vocab: int, fields: dict) -> dict:
  """Writes the run's JSON under --out; returns it (with its path)."""
  os.makedirs(args.out, exist_ok=True)
  kind = "check" if args.check_steps else "train"
  path = os.path.join(args.out, f"{kind}_lm_{args.framework}_{args.variant}_"
                                f"{datetime.date.today().isoformat()}_{device_slug()}.json")
  record = dict(framework=args.framework, variant=args.variant, config=dataclasses.asdict(cfg),
                jax=jax.__version__, device=jax.devices()[0].device_kind, vocab=vocab,
                xla_flags=os.environ.get("XLA_FLAGS", ""), **fields)
  with open(path, "w") as f:
    json.dump(record, f, indent=1)
  print(f"wrote {path}")
  return dict(record, path=path)


if __name__ == "__main__":
  main()
