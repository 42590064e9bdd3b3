"""Tile configurations for the kernel templates and their default heuristic.

Each config checks its fields on construction, so that a bad one fails there
and never reaches a kernel: tiles are powers of two of at least 16 (Triton's
tile shapes and dot operands; what Mosaic GPU takes beyond that is checked in
kernels/lowering.py), counts positive, launch parameters within what the
backends take.
"""
from __future__ import annotations

import dataclasses
import numbers

MAX_STAGES = 8  # the deepest software pipeline / TMA ring the search spaces try

# Rules for `check_value`: (test, what it allows).
TILE = (lambda n: n >= 16 and n & (n - 1) == 0, "a power of two >= 16 (a tile dimension)")
# Query rows of a parallel program: a tile, or the 192 rows of three Mosaic GPU
# consumer warpgroups (the fp8 forward's).
Q_ROWS = (lambda n: TILE[0](n) or n == 192,
          "a power of two >= 16 (a tile dimension) or 192 (Mosaic GPU's fp8 forward)")
COUNT = (lambda n: n >= 1, "an integer >= 1")
STAGES = (lambda n: 1 <= n <= MAX_STAGES, f"an integer in 1..{MAX_STAGES}")
TRITON_WARPS = (lambda n: n in (1, 2, 4, 8, 16),
                "one of 1, 2, 4, 8, 16 (Triton's warps: a power of two)")
# Mosaic GPU programs run a warpgroup (4 warps) per 64-row consumer and one producer.
ATTENTION_WARPS = (lambda n: n in (1, 2, 4, 8, 12, 16),
                   "one of 1, 2, 4, 8, 12, 16 (a power of two for Triton; 8, 12 or 16 for "
                   "Mosaic GPU: its consumer warpgroups and the producer)")


def check_value(name: str, value, rule) -> None:
  """Raises a ValueError naming `name`, the `value` and what `rule` allows."""
  test, allowed = rule
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not test(value):
    raise ValueError(f"{name} must be {allowed}; got {value!r}")


def _validate(config, *, unset_ok: bool = False, **rules) -> None:
  """Checks a config's fields against their rules (None passes where `unset_ok`)."""
  for name, rule in rules.items():
    value = getattr(config, name)
    if not (unset_ok and value is None):
      check_value(f"{type(config).__name__}.{name}", value, rule)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Tiles and launch parameters of the parallel (flash-style) templates.

  block_q: query rows per program (a power of two; 192 for the Mosaic GPU
  fp8 forward's three consumer warpgroups); block_k: key rows per
  inner-loop step; num_warps / num_stages: Triton launch and
  software-pipelining depth.
  """
  block_q: int = 128
  block_k: int = 64
  num_warps: int = 8
  num_stages: int = 3

  def __post_init__(self):
    _validate(self, block_q=Q_ROWS, block_k=TILE, num_warps=ATTENTION_WARPS, num_stages=STAGES)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict) -> "AttentionConfig":
    return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


def next_power_of_2(n: int) -> int:
  return 1 << max(0, (int(n) - 1).bit_length())


def padded_head_dim(d: int) -> int:
  """Head dims as the Triton kernels hold them: a power of two, at least 16."""
  return max(16, next_power_of_2(d))


def round_up(n: int, multiple: int) -> int:
  """`n` padded to a multiple of `multiple` (a sequence to whole blocks)."""
  return -(-n // multiple) * multiple


def clamp_block(block: int, length: int, minimum: int = 16) -> int:
  """Shrinks a block to the (power-of-two padded) length for short sequences."""
  return max(minimum, min(block, next_power_of_2(length)))


def heuristic_config(seq_q: int, seq_kv: int, d_qk: int, d_v: int, *,
                     block_sparse: bool = False, scores_per_position: bool = False,
                     itemsize: int = 2) -> AttentionConfig:
  """A reasonable default without tuning (Hopper-class GPUs, Triton).

  Head dims count as padded to powers of two (>= 16). Up to 256 + 128
  (e.g. Dqk 192, Dv 128) the 128x64 tiles with 3 stages still fit shared
  memory (measured on an H200: 1.04x vanilla's rate, against 0.81x with the
  small tiles); only larger heads fall back to 64x32. Under a mask_mod
  (`block_sparse`), heads of up to 128 take 128-wide key blocks: programs
  are shorter there, and fewer, longer loop steps pay (H200, B4 H16 d128,
  kernel time: causal 0.754 -> 0.714 ms at S=4k, 2.55 -> 2.36 ms at 16k,
  where the dense time is 1.33 / 4.92 ms; the tuner picked these tiles for
  sliding windows and for causal at 16k too). Not where score_mod is
  evaluated per position (`scores_per_position`: not absent, not a bias
  from vectors): RetNet's decay asked for 352 KiB there on an H200, over
  Hopper's 227 KiB, and ran fastest on 128x64 tiles (0.725 ms against
  1.112 on 128x128 with two stages, B4 H16 S4096;
  benchmarks/results/2026-11-26_h200/probe_retention_tiles.json).

  float32 inputs (`itemsize` 4) take 32x32 tiles on two stages: their
  products run as three TF32 products (`backend.dot`), whose operand
  splits Triton stages in shared memory (64x64 tiles asked for 256-352 KiB
  at heads of 128-256); at B4 H16 S4096, causal ALiBi, on an H200 they ran
  a d 128 forward in 11.3 ms (first call 2.6 s) and Dqk 192 / Dv 128 in
  28.7 ms (5.0 s), where IEEE products took 30 / 140 ms on their best
  tiles (benchmarks/results/2026-11-26_h200/probe_fp32_tiles.jsonl).
  """
  d_qk, d_v = (max(16, next_power_of_2(d)) for d in (d_qk, d_v))
  if itemsize > 2:
    cfg = AttentionConfig(block_q=32, block_k=32, num_warps=4, num_stages=2)
  elif max(d_qk, d_v) <= 64:
    cfg = AttentionConfig(block_q=128, block_k=64, num_warps=4, num_stages=3)
  elif d_qk + d_v <= 384:
    wide_keys = block_sparse and not scores_per_position and max(d_qk, d_v) <= 128
    cfg = AttentionConfig(block_q=128, block_k=128 if wide_keys else 64, num_warps=8,
                          num_stages=3)
  else:
    cfg = AttentionConfig(block_q=64, block_k=32, num_warps=4, num_stages=2)
  return dataclasses.replace(
      cfg,
      block_q=clamp_block(cfg.block_q, seq_q),
      block_k=clamp_block(cfg.block_k, seq_kv))


@dataclasses.dataclass(frozen=True)
class LinearAttentionConfig:
  """Tiles of the chunked-recurrent (linear attention) templates.

  chunk_size: tokens per chunk (intra-chunk part runs as dense matmuls);
  block_v: Dv columns per program; num_warps / num_stages as above. These
  tile the parallel (output and gradient) passes; the sequential state pass
  sizes its own tiles and stages from the shape (`state_tile`,
  `state_pass_stages` in kernels/linear/chunked_forward.py).
  """
  chunk_size: int = 64
  block_v: int = 64
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    _validate(self, chunk_size=TILE, block_v=TILE, num_warps=TRITON_WARPS, num_stages=STAGES)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict) -> "LinearAttentionConfig":
    return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Tiles and launch parameters of the split-KV (decoding) template.

  block_k: keys per inner-loop step; num_splits: programs that share one
  sequence's keys (each folds a contiguous run of key blocks; the runs are
  merged afterwards); block_rows: packed query rows per program (the query
  heads of one kv head times the query tokens; more rows take several
  programs, each reading the keys again); num_warps / num_stages: Triton
  launch and software-pipelining depth. Fields left None come from the
  schedule (`heuristic_decode_config`).
  """
  block_k: int | None = None
  num_splits: int | None = None
  block_rows: int | None = None
  num_warps: int = 4
  num_stages: int | None = None

  def __post_init__(self):
    _validate(self, num_warps=TRITON_WARPS)
    _validate(self, unset_ok=True, block_k=TILE, num_splits=COUNT, block_rows=TILE,
              num_stages=STAGES)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict) -> "DecodeConfig":
    return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


MAX_DECODE_ROWS = 64  # default row tile: 64 x 128 float32 accumulators on 4 warps
DECODE_STAGES = 3
# An fp8 cache's tiles carry half the bytes: a fourth stage keeps enough in
# flight (H200, B8 32k: 0.168 ms against 0.176 at three; five and six ran
# slower, 256-key tiles too).
FP8_DECODE_STAGES = 4
DECODE_SMEM = 192 * 1024  # bytes of pipelined K/V tiles the default block_k stays within
# Waves of programs (per slot: SM x programs an SM holds) the split count
# makes at least. A contiguous cache reads fastest in one wave: a second
# drains and refills each SM's pipeline (H100, 2026-11-27, B8 8k / B8 32k /
# B1 128k: bf16 and fp8 caches 2-8% faster than in two); a paged one in two
# (in one, 2-27% slower), an fp8 paged one in three (1.7-2.2% faster than
# two; a bf16 one up to 2% slower).
CONTIGUOUS_DECODE_WAVES = 1
PAGED_DECODE_WAVES = 2
FP8_PAGED_DECODE_WAVES = 3
DECODE_WAVE_FILL = 0.9  # the fraction of the last wave's slots the split count fills
MIN_BLOCKS_PER_SPLIT = 4  # a split's fixed costs (q load, partial write) stay amortized


def heuristic_decode_config(batch: int, heads_kv: int, rows: int, seq_kv: int, d_qk: int,
                            d_v: int, *, itemsize: int = 2, sm_count: int | None = None,
                            smem_per_block: int | None = None,
                            base: DecodeConfig | None = None, paged: bool = False) -> DecodeConfig:
  """The split-KV schedule: `base`'s fields where set, the rest from the shape.

  Decoding reads every cached key once and computes little on it, so the
  schedule is about bandwidth: the largest key tile up to 128 whose
  `DECODE_STAGES` (`itemsize` 1, an fp8 cache: `FP8_DECODE_STAGES`)
  pipelined K/V copies fit `DECODE_SMEM` (and the device's
  shared memory), and programs that keep every SM streaming to the end.
  Programs are batch x kv heads x row blocks x splits of the `seq_kv`-key
  cache; the split count (`decode_splits`) is the smallest that makes at
  least `CONTIGUOUS_DECODE_WAVES` (`paged`: `PAGED_DECODE_WAVES`, for fp8
  `FP8_PAGED_DECODE_WAVES`) waves over the device's program slots and fills
  `DECODE_WAVE_FILL` of the last one (sm_count from schedule/device.py;
  None, e.g. interpret mode, takes one split). `rows` is the query heads
  per kv head times the query tokens; head dims count as padded to powers
  of two.
  """
  base = base or DecodeConfig()
  d_qk, d_v = (max(16, next_power_of_2(d)) for d in (d_qk, d_v))
  stages = base.num_stages or (DECODE_STAGES if itemsize > 1 else FP8_DECODE_STAGES)
  budget = min(DECODE_SMEM, smem_per_block or DECODE_SMEM)
  block_k = base.block_k
  if block_k is None:
    block_k = 128
    while block_k > 16 and stages * block_k * (d_qk + d_v) * itemsize > budget:
      block_k //= 2
  block_k = clamp_block(block_k, seq_kv)
  block_rows = base.block_rows or clamp_block(MAX_DECODE_ROWS, rows)
  num_splits = base.num_splits
  if num_splits is None:
    smem = (stages * block_k * (d_qk + d_v) + block_rows * d_qk) * itemsize
    per_sm = max(1, (smem_per_block or smem) // smem)
    waves = CONTIGUOUS_DECODE_WAVES
    if paged:
      waves = FP8_PAGED_DECODE_WAVES if itemsize == 1 else PAGED_DECODE_WAVES
    num_splits = decode_splits(batch * heads_kv * -(-rows // block_rows),
                               -(-seq_kv // block_k), (sm_count or 0) * per_sm, waves)
  return dataclasses.replace(base, block_k=block_k, num_splits=num_splits,
                             block_rows=block_rows, num_stages=stages)


def decode_splits(programs: int, key_blocks: int, slots: int, min_waves: int) -> int:
  """The splits of `key_blocks` key blocks for `programs` programs per
  split on `slots` program slots (0: one split), in `min_waves` waves at
  least. A split takes `ceil(key_blocks / splits)` blocks, so only
  `ceil(key_blocks / that)` splits have work; waves count those programs."""
  most = max(1, key_blocks // MIN_BLOCKS_PER_SPLIT)
  best, best_fill = 1, 0.0
  for splits in range(1, most + 1) if slots else ():
    per_split = -(-key_blocks // splits)
    working = programs * -(-key_blocks // per_split)
    waves = -(-working // slots)
    fill = working / (waves * slots)
    if waves >= min_waves and fill >= DECODE_WAVE_FILL:
      return splits
    if fill > best_fill + 1e-9 or waves < min_waves:
      best, best_fill = splits, fill
  return best

MAX_DECODE_QUERIES = 16  # query tokens per sequence the split-KV template takes
SPLIT_KV_MIN_KEYS = 256


def prefers_split_kv(seq_q: int, seq_kv: int) -> bool:
  """Whether `attention` runs a call on the split-KV template.

  With at most `MAX_DECODE_QUERIES` queries, the parallel template has one
  program per (batch, query head) walking all keys and reads each kv head's
  keys once per query head of its group; the split-KV template packs the
  group's queries into one tile, reads the keys once and splits them over
  the SMs (on an H200, B=8, 32 query / 8 kv heads, d=128, 32k keys, the
  parallel template read the keys at 1.4 TB/s, cuDNN at 4.3). Below
  `SPLIT_KV_MIN_KEYS` keys both are a few microseconds and the parallel
  template saves the combine step.
  """
  return seq_q <= MAX_DECODE_QUERIES and seq_kv >= SPLIT_KV_MIN_KEYS
